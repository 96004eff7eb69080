"""C10's throughput check without a GPU: the workload option and its defaults per device, the
seeded requests, the timing loop and the ratio check against engines with a planted clock (a 4x
slower invariant engine must fail --min-throughput-ratio 0.5: the negative control), and the
whole gate end to end on the fake vLLM worker (its clock coming back through the worker protocol),
the workload and ratio in report.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.checks.throughput import (check_ratio, parse_min_throughput_ratio, throughput_metrics,
                                        time_rollout)
from fixtures.checks.workloads import (MIN_ROLLOUT_TOKENS, ROLLOUT_ACCELERATOR, ROLLOUT_CPU, RolloutWorkload,
                                       parse_rollout_workload, rollout_workload)
from fixtures.core.contract import Completion, EngineStats, Sample

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]
SMALL = RolloutWorkload(prompts=4, prompt_tokens=9, max_tokens=13, n=4)


# ---------------------------------------------------------------------------------------------
# the workload: option, defaults, requests
# ---------------------------------------------------------------------------------------------
def test_defaults_depend_on_the_device():
    gpu = rollout_workload(None, "cuda")
    assert gpu == ROLLOUT_ACCELERATOR and gpu.prompts >= 256 and gpu.prompt_tokens >= 256 and gpu.max_tokens >= 128
    assert gpu.n > 1 and gpu.temperature == 1.0
    assert rollout_workload(None, "cpu") == ROLLOUT_CPU and rollout_workload("", "cpu:0") == ROLLOUT_CPU
    assert ROLLOUT_CPU.generated_tokens >= MIN_ROLLOUT_TOKENS
    assert rollout_workload("16,32,8,2", "cuda") == RolloutWorkload(16, 32, 8, 2)     # the option wins


@pytest.mark.parametrize("text, needle", [
    ("8,16", "expected PROMPTS,IN,OUT,N"), ("8,16,8,4,1", "expected PROMPTS,IN,OUT,N"),
    ("8,16,0,4", "whole numbers >= 1"), ("a,b,c,d", "whole numbers >= 1"), ("8,16,8.5,4", "whole numbers"),
    ("2,16,8,4", f"64 generated tokens per run; need >= {MIN_ROLLOUT_TOKENS}"),
])
def test_bad_workloads_are_refused(text, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        parse_rollout_workload(text)


def test_workload_spelling_round_trips():
    w = parse_rollout_workload(" 256, 256 ,128,4")
    assert w == ROLLOUT_ACCELERATOR and parse_rollout_workload(w.spelling()) == w and w.generated_tokens == 131072
    assert "256 prompts x 256 tokens in, n=4 samples x 128 tokens out (131072 generated per run)" in w.describe()


@pytest.mark.parametrize("text, value", [(None, None), ("", None), ("0.5", 0.5), ("1", 1.0), ("1e-3", 0.001)])
def test_min_ratio_parses(text, value):
    assert parse_min_throughput_ratio(text) == value


@pytest.mark.parametrize("text", ["0", "-0.5", "1.01", "nan", "inf", "fast"])
def test_min_ratio_out_of_range_is_refused(text):
    with pytest.raises(ValueError, match=r"0 < R <= 1"):
        parse_min_throughput_ratio(text)


def test_requests_are_the_workload_seeded_and_new_per_run():
    a, b = SMALL.requests(1000, run=1), SMALL.requests(1000, run=1)
    assert a == b, "the same run gives the same requests (on and off engines time the same workload)"
    assert len(a) == 4 and all(len(r.prompt_ids) == 9 for r in a)
    assert all(r.params.max_tokens == 13 and r.params.n == 4 and r.params.temperature == 1.0 and r.params.ignore_eos
               for r in a)
    assert len({r.params.seed for r in a}) == 4
    other = SMALL.requests(1000, run=2)
    assert not {r.prompt_ids for r in a} & {r.prompt_ids for r in other}, "each run draws its own prompts"
    assert not {r.request_id for r in a} & {r.request_id for r in other}


# ---------------------------------------------------------------------------------------------
# the timing loop and the ratio check, on in-process engines with a planted clock
# ---------------------------------------------------------------------------------------------
class ClockedEngine:
    """Generates exactly what is asked; reports `seconds_per_token` as its own clock (None: none).
    `short` drops a token from every sample; `graph_steps` is what it claims to have replayed."""

    def __init__(self, seconds_per_token: float | None, *, short: bool = False, graph_steps: int = 0):
        self.spt, self.short, self.graph_steps = seconds_per_token, short, graph_steps
        self.calls: list[int] = []
        self._stats = EngineStats()

    def generate(self, requests):
        out = []
        for r in requests:
            k = r.params.max_tokens - (1 if self.short else 0)
            out.append(Completion(r.request_id, r.prompt_ids,
                                  [Sample([1] * k, torch.zeros(k)) for _ in range(r.params.n)]))
        tokens = sum(len(s.token_ids) for c in out for s in c.samples)
        self.calls.append(tokens)
        self._stats = EngineStats(steps=3, graph_steps=self.graph_steps,
                                  generate_seconds=None if self.spt is None else tokens * self.spt)
        return out

    def last_stats(self):
        return self._stats


def _measure(spt_on, spt_off, **kw):
    on = time_rollout(ClockedEngine(spt_on, **kw), SMALL, 1000, batch_invariant=True, cuda_graphs=False)
    off = time_rollout(ClockedEngine(spt_off, **kw), SMALL, 1000, batch_invariant=False, cuda_graphs=False)
    return on, off


def test_warm_up_then_timed_runs_on_the_engine_clock():
    eng = ClockedEngine(1e-4)
    m = time_rollout(eng, SMALL, 1000, batch_invariant=True, cuda_graphs=False, repeats=2)
    assert eng.calls == [SMALL.generated_tokens] * 3, "a full-size warm-up, then two timed runs"
    assert m.clock == "engine" and m.tokens == SMALL.generated_tokens and m.seconds == pytest.approx(208 * 1e-4)
    assert m.tokens_per_s == pytest.approx(1e4)


def test_without_an_engine_clock_the_caller_times_it():
    m = time_rollout(ClockedEngine(None), SMALL, 1000, batch_invariant=True, cuda_graphs=False)
    assert m.clock == "caller" and m.seconds > 0


def test_slow_invariant_engine_fails_the_minimum():
    """The negative control: invariance 4x slower must fail --min-throughput-ratio 0.5, with both
    sides and the workload in the message; without a minimum the ratio is only reported."""
    on, off = _measure(4e-4, 1e-4)
    with pytest.raises(AssertionError) as info:
        check_ratio(on, off, 0.5, SMALL)
    text = str(info.value)
    assert "throughput ratio 0.250 below --min-throughput-ratio 0.5" in text
    assert "2500 tok/s" in text and "10000 tok/s" in text and SMALL.describe() in text
    assert check_ratio(on, off, None, SMALL) == pytest.approx(0.25)
    assert check_ratio(on, off, 0.25, SMALL) == pytest.approx(0.25)      # at the minimum: passes


def test_equal_engines_pass_any_minimum():
    on, off = _measure(1e-4, 1e-4)
    assert check_ratio(on, off, 1.0, SMALL) == pytest.approx(1.0)


def test_a_short_run_is_not_the_workload():
    with pytest.raises(AssertionError, match="not the same workload"):
        time_rollout(ClockedEngine(1e-4, short=True), SMALL, 1000, batch_invariant=False, cuda_graphs=False)


def test_graphs_asked_but_not_replayed_fails():
    with pytest.raises(AssertionError, match="none of the run's 3 steps replayed a captured graph"):
        time_rollout(ClockedEngine(1e-4), SMALL, 1000, batch_invariant=True, cuda_graphs=True)
    m = time_rollout(ClockedEngine(1e-4, graph_steps=2), SMALL, 1000, batch_invariant=True, cuda_graphs=True)
    assert m.cuda_graphs and m.graph_steps == 2


def test_metrics_say_what_was_measured():
    on, off = _measure(2e-4, 1e-4)
    got = throughput_metrics(SMALL, on, off)
    assert got["throughput_ratio"] == 0.5 and got["rollout_tokens_generated"] == 208
    assert got["rollout_workload"].endswith("[--rollout-workload=4,9,13,4]") and got["rollout_clock"] == "engine"
    assert got["rollout_cuda_graphs"].startswith("off") and got["throughput_on_seconds"] == round(208 * 2e-4, 4)
    from fixtures.plugin.report import throughput_section
    rows = throughput_section([{"gate": "C10", "model": "qwen3", "name": k, "value": v} for k, v in got.items()])
    assert rows[1] == "## Throughput (C10)" and rows[-1].startswith("| qwen3 | 4 prompts x 9 tokens in")
    assert "| **0.5** |" in rows[-1]
    assert throughput_section([{"gate": "C7", "model": "qwen3", "name": "k1", "value": 0}]) == []


# ---------------------------------------------------------------------------------------------
# the options and the gate end to end
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--min-throughput-ratio=1.5"], "--min-throughput-ratio=1.5: expected a ratio R with 0 < R <= 1"),
    (["--min-throughput-ratio", "0"], "--min-throughput-ratio=0: expected a ratio"),
    (["--min-throughput-ratio=fast"], "--min-throughput-ratio=fast: expected a ratio"),
    (["--rollout-workload=8,16"], "--rollout-workload=8,16: expected PROMPTS,IN,OUT,N"),
    (["--rollout-workload", "1,16,8,4"], "--rollout-workload=1,16,8,4: PROMPTS x N x OUT = 32 generated tokens"),
])
def test_bad_options_are_one_usage_error(pytester, monkeypatch, args, needle):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = pytester.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                       *args)
    err = res.stderr.str()
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str() + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ERROR: ") and needle in lines[0], err


FACTORIES = '''
from fixtures.vllm.implementation import VLLMImplementation
class FakeVLLM(VLLMImplementation):
    def device(self):
        return "cpu"        # the fake worker runs anywhere: not skipped as "no CUDA"
def slow():
    return FakeVLLM(fake="slow_invariant", max_idle=0)
'''


def _run_c10(tmp_path, factory: str, *args) -> tuple[subprocess.CompletedProcess, Path]:
    """The real gate module, on the fake vLLM worker (its clock planted), with a small workload."""
    (tmp_path / "c10_fakes.py").write_text(FACTORIES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CONFORMANCE_VLLM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    env["CONFORMANCE_VLLM_LOG_DIR"] = str(tmp_path / "logs")
    report = tmp_path / f"report-{factory}"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "tests_c10_delivery/test_c10_delivery.py", "-k", "throughput", f"--impl=c10_fakes:{factory}",
                          "--model=qwen3", "--rollout-workload=8,16,8,4", f"--report={report}",
                          f"--basetemp={tmp_path / ('base-' + factory)}", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return res, report


def test_gate_end_to_end_on_the_fake_worker(tmp_path):
    """The real gate through the vLLM worker protocol, its clock planted 4x slower with invariance
    on: --min-throughput-ratio 0.5 fails (the negative control seen to fail), the repro passes both
    options again, and report.md still says what was measured: the workload, CUDA graphs on (the
    fake declares them and shows a replayed step), tokens, both sides, the ratio, the worker's clock.
    (Equal engines passing a minimum: test_equal_engines_pass_any_minimum.)"""
    res, report = _run_c10(tmp_path, "slow", "--min-throughput-ratio=0.5")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "throughput ratio 0.250 below --min-throughput-ratio 0.5" in res.stdout
    assert "--min-throughput-ratio=0.5" in res.stdout and "--rollout-workload=8,16,8,4" in res.stdout   # the repro
    md = (report / "report.md").read_text()
    section = md.split("## Throughput (C10)", 1)[1].split("##", 1)[0]
    assert "| qwen3 | 8 prompts x 16 tokens in, n=4 samples x 8 tokens out (256 generated per run)" in section
    assert "[--rollout-workload=8,16,8,4] | on | 256 | 2500.0 (0.1024) | 10000.0 (0.0256) | **0.25** | engine |" \
        in section, section
    names = {m["name"] for m in json.loads((report / "report.json").read_text())["metrics"]}
    assert {"throughput_ratio", "throughput_on_tok_s", "throughput_off_tok_s", "rollout_workload",
            "rollout_cuda_graphs", "rollout_tokens_generated", "throughput_on_seconds",
            "throughput_off_seconds", "throughput_ratio_rounds", "rollout_preemptions_on", "rollout_preemptions_off",
            "rollout_workload_fit"} <= names
    metrics = {m["name"]: m["value"] for m in json.loads((report / "report.json").read_text())["metrics"]}
    assert metrics["throughput_ratio_rounds"].startswith("min 0.250 / median 0.250 / max 0.250 over 3 rounds")
    assert metrics["rollout_workload_fit"].startswith("as given (--rollout-workload)")


def test_side_by_side_script_runs_three_engines(monkeypatch, capsys):
    """benchmarks/c10_side_by_side_gpu.py (issue #21's stock / invariance / invariance + fixes table)
    on the fake worker: three engines, the fixes only in the third one's environment, one table."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "c10_side_by_side_gpu.py"
    spec = importlib.util.spec_from_file_location("c10_side_by_side_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from fixtures.vllm import client
    started = []
    real = client.VLLMEngine.__init__

    def spy(self, model_dir, settings=None, **kw):
        started.append((settings.batch_invariant, dict(settings.extra["env"])["CONFORMANCE_VLLM_FIXES"]))
        real(self, model_dir, settings, **kw)
    monkeypatch.setattr(client.VLLMEngine, "__init__", spy)
    assert mod.main(["--model", "qwen3", "--proxy", "tiny", "--fake", "echo", "--rollout-workload", "8,16,16,2",
                     "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| stock (invariance off)", "| invariance on", "| invariance on + fixes"]
    assert sorted(set(started)) == [(False, "none"), (True, "all"), (True, "none")]
    assert len(started) == 4, f"one eager probe for CUDA graphs, then one engine per configuration: {started}"
    assert mod.main(["--rounds", "0"]) == 2


def test_side_by_side_ratios_are_per_round_medians_with_their_spread():
    """The table's ratio is the median of the per-round ratios (stock of the same round), with min
    and max: a drifting machine shows as spread, not as a ratio."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace as T
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "c10_side_by_side_gpu.py"
    spec = importlib.util.spec_from_file_location("c10_side_by_side_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def runs(*tok):
        return [T(tokens_per_s=t, steps=10, graph_steps=9, max_running=8, preemptions=1) for t in tok]
    names = [n for n, _, _ in mod.CONFIGS]
    out = mod.table({names[0]: runs(100, 200, 100), names[1]: runs(80, 100, 90), names[2]: runs(90, 180, 95)},
                    T(describe=lambda: "w"), "fits")
    rows = {r.split(" | ")[0][2:]: r for r in out.splitlines() if r.startswith("| ") and "tok/s" not in r}
    assert "| 0.800 (0.500 - 0.900) |" in rows["invariance on"], out        # ratios 0.8, 0.5, 0.9
    assert "| 0.900 (0.900 - 0.950) |" in rows["invariance on + fixes"], out  # 0.9, 0.9, 0.95
    assert "3 over the rounds" in rows["stock (invariance off)"] and "w (fits)" in out


def test_side_by_side_profiles_each_engine_after_its_timed_runs(capsys):
    """--profile-top: one more rollout per engine under the profiler, its kernels by device time
    printed per engine (the fake worker's two canned kernels); a negative count is a usage error."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "c10_side_by_side_gpu.py"
    spec = importlib.util.spec_from_file_location("c10_side_by_side_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", "qwen3", "--proxy", "tiny", "--fake", "echo", "--rollout-workload", "8,16,16,2",
                     "--rounds", "1", "--profile-top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("ms of device time in 2 kernels") == 3, out
    assert out.count("| `fake_gemm_kernel` | 40 | 0.3 | 75.0% |") == 3 and "fake_norm_kernel" not in out, out
    assert mod.main(["--profile-top", "-1"]) == 2


def test_kernel_ranking_orders_by_device_time_and_counts_every_kernel():
    from types import SimpleNamespace as E
    from fixtures.vllm.kernel_profile import rank_kernels
    events = [E(key="a", count=3, self_device_time_total=5.0), E(key="b", count=1, self_device_time_total=50.0),
              E(key="cpu_op", count=9, self_device_time_total=0.0), E(key="c", count=2, self_cuda_time_total=7.0)]
    got = rank_kernels(events, top=2)
    assert got == {"top": [["b", 1, 50.0], ["c", 2, 7.0]], "total_us": 62.0, "kernels": 3}


# ---------------------------------------------------------------------------------------------
# C10 sized to the card: the workload fitted to the KV cache, rounds alternating the sides
# ---------------------------------------------------------------------------------------------
def test_workload_fits_the_smallest_kv_cache():
    """256 prompts x 4 samples, 256 + 128 tokens each: 256 running sequences (max_num_seqs) need
    98,304 tokens; a 65,536-token cache holds 170 of them, so 42 prompts (168 sequences)."""
    from fixtures.checks.throughput import fit_to_kv_cache
    small = {"tokens": 65536, "block_size": 16, "max_num_seqs": 256}
    big = {"tokens": 1 << 20, "block_size": 16, "max_num_seqs": 256}
    w, note = fit_to_kv_cache(ROLLOUT_ACCELERATOR, [big, small])
    assert w == RolloutWorkload(42, 256, 128, 4) and "256 -> 42 prompts" in note and "65536 tokens" in note
    assert fit_to_kv_cache(ROLLOUT_ACCELERATOR, [big]) == (ROLLOUT_ACCELERATOR, fit_to_kv_cache(
        ROLLOUT_ACCELERATOR, [big])[1]) and fit_to_kv_cache(ROLLOUT_ACCELERATOR, [big])[1].startswith("fits")
    odd, _ = fit_to_kv_cache(RolloutWorkload(8, 250, 10, 1), [{"tokens": 5 * 272, "block_size": 16, "max_num_seqs": 8}])
    assert odd.prompts == 5, "a sequence takes whole blocks: 260 tokens -> 272"
    with pytest.raises(ValueError, match="not even one prompt's 4 samples"):
        fit_to_kv_cache(ROLLOUT_ACCELERATOR, [{"tokens": 1000, "block_size": 16, "max_num_seqs": 256}])
    assert fit_to_kv_cache(SMALL, [])[0] == SMALL


class PreemptingEngine(ClockedEngine):
    """A ClockedEngine whose clock drifts by `drift` per call and which reports `preempt` preemptions a run."""

    def __init__(self, spt, *, drift=0.0, preempt=0):
        super().__init__(spt)
        self.drift, self.preempt = drift, preempt

    def generate(self, requests):
        out = super().generate(requests)
        self.spt *= 1 + self.drift
        self._stats = EngineStats(steps=3, preemptions=self.preempt, generate_seconds=self._stats.generate_seconds)
        return out


def test_rounds_alternate_the_sides_and_report_the_spread():
    """Round i times stock, then invariance on, on run i's prompts; the ratio is the median of the
    rounds' ratios, its spread and both sides' preemptions reported; a drifting invariant engine shows
    as spread."""
    from fixtures.checks.throughput import time_rounds
    order = []
    on, off = PreemptingEngine(2e-4, drift=0.5, preempt=3), PreemptingEngine(1e-4, preempt=1)
    for name, eng in (("on", on), ("off", off)):
        real = eng.generate
        eng.generate = lambda reqs, real=real, name=name: (order.append((name, reqs[0].request_id)), real(reqs))[1]
    r = time_rounds(on, off, SMALL, 1000, cuda_graphs=False, rounds=3)
    assert [n for n, _ in order] == ["off", "on"] * 3
    assert order[0][1] == order[1][1] and order[0][1] != order[2][1], "both sides of a round time the same prompts"
    assert r.ratios == pytest.approx([0.5, 0.5 / 1.5, 0.5 / 2.25])
    assert r.spread() == pytest.approx((0.5 / 2.25, 0.5 / 1.5, 0.5))
    assert r.preemptions(True) == 9 and r.preemptions(False) == 3
    assert "min 0.222 / median 0.333 / max 0.500" in r.describe() and "preemptions on 9, off 3" in r.describe()
    got = throughput_metrics(SMALL, r.best(True), r.best(False), r, "fits")
    assert got["throughput_ratio"] == 0.333 and got["rollout_preemptions_on"] == 9
    assert got["throughput_ratio_rounds"].startswith("min 0.222 / median 0.333 / max 0.500 over 3 rounds")
    assert got["rollout_workload_fit"] == "fits"
    with pytest.raises(AssertionError, match="throughput ratio 0.333 below --min-throughput-ratio 0.5.*min 0.222"):
        check_ratio(r.best(True), r.best(False), 0.5, SMALL, r)


def test_fake_engine_reports_its_kv_cache(tmp_path):
    from fixtures.core.contract import EngineSettings, ReportsKVCache
    from fixtures.vllm.implementation import VLLMImplementation
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    impl = VLLMImplementation(fake="echo", max_idle=0)
    try:
        with impl.make_engine(d, EngineSettings(kv_cache_blocks=64)) as eng:
            assert isinstance(eng, ReportsKVCache)
            assert eng.kv_cache_capacity() == {"tokens": 64 * 16, "block_size": 16, "max_num_seqs": 256}
    finally:
        impl.pool.close_all()
