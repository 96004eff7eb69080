"""The records lane (docs/records.md) on the suite's own stack: the reference engine and trainer,
driven through a probe plan into records, judge green on C6, C7 and C9; each planted fault is seen
red through the records alone; bad records are one line and exit 4; a plan not followed, or records
too few to judge, never read green."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.records import judge
from fixtures.records.format import RecordsError
from fixtures.records.plan import make_plan, plan_gaps, write_plan
from fixtures.records.reader import load_records
from fixtures.records.writer import RecordWriter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    from fixtures.models.proxies import build_proxy
    return build_proxy("llama", "tiny", tmp_path_factory.mktemp("proxy"), seed=0)


@pytest.fixture(scope="module")
def plan(proxy):
    return make_plan("llama", proxy.config.vocab_size)


def _drive(tmp_path_factory, proxy, plan, fault=None) -> Path:
    from fixtures.records.drive import drive_reference
    out = tmp_path_factory.mktemp(f"records-{fault or 'clean'}")
    write_plan(plan, out)
    return drive_reference(plan, out, proxy.path, fault=fault)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, proxy, plan) -> Path:
    return _drive(tmp_path_factory, proxy, plan)


def run_pytest(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYPOTHESIS_PROFILE", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def verdict_rows(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in {f"C{i}" for i in range(11)} and len(parts) >= 3 and "[" not in line:
            rows[parts[0]] = line.split("  ")[-1].strip()
    return rows


# ---------------------------------------------------------------------------------------------
# green on the reference stack, through pytest
# ---------------------------------------------------------------------------------------------
def test_reference_records_judge_green(clean):
    res = run_pytest(f"--records={clean}", "--strict-gates", "-m", "C6 or C7 or C9")
    rows = verdict_rows(res.stdout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert rows.get("C6") == rows.get("C7") == rows.get("C9") == "PASS", res.stdout[-2000:]


def test_other_gates_read_not_run(clean):
    res = run_pytest(f"--records={clean}", "-m", "C3 or C7")
    rows = verdict_rows(res.stdout)
    assert rows.get("C3") == "NOT RUN" and rows.get("C7") == "PASS", res.stdout[-2000:]
    assert "the records carry no engine or trainer" in res.stdout


def test_plan_is_written_and_followed(clean, plan, tmp_path):
    res = run_pytest(f"--write-plan={tmp_path}", "--model=llama")
    assert res.returncode == 0 and (tmp_path / "plan.json").is_file(), res.stdout + res.stderr
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(plan))
    assert plan_gaps(load_records(clean), plan) == []


# ---------------------------------------------------------------------------------------------
# planted faults, seen red through the records alone
# ---------------------------------------------------------------------------------------------
def test_one_ulp_off_is_red_at_c7(tmp_path_factory, proxy, plan):
    recs = load_records(_drive(tmp_path_factory, proxy, plan, fault="ulp"))
    with pytest.raises(AssertionError) as err:
        judge.judge_parity(recs)
    text = str(err.value)
    assert "1 ULP apart" in text and "0x" in text and "first differing sequence: step 1 sequence" in text, text
    assert "differing positions: 1 of" in text, text


def test_skipped_tensor_in_a_push_is_red_at_c9(tmp_path_factory, proxy, plan):
    recs = load_records(_drive(tmp_path_factory, proxy, plan, fault="skipped_tensor"))
    with pytest.raises(AssertionError, match="tensors differ between the engine"):
        judge.judge_two_steps(recs)


def test_micro_batch_dependent_trainer_is_red_at_c6(tmp_path_factory, proxy, plan):
    recs = load_records(_drive(tmp_path_factory, proxy, plan, fault="micro_batch"))
    with pytest.raises(AssertionError, match="C6 \\(records\\)"):
        judge.judge_composition(recs)


def test_red_records_fail_the_gate_through_pytest(tmp_path_factory, proxy, plan):
    res = run_pytest(f"--records={_drive(tmp_path_factory, proxy, plan, fault='ulp')}", "-m", "C7")
    assert res.returncode == 1 and verdict_rows(res.stdout).get("C7") == "FAIL", res.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# too few to judge, or a plan not followed: incomplete, never green
# ---------------------------------------------------------------------------------------------
def _copy_without(src: Path, dst: Path, drop) -> Path:
    shutil.copytree(src, dst)
    index = dst / "rank-00000" / "records.jsonl"
    lines = [l for l in index.read_text().splitlines() if not drop(json.loads(l))]
    index.write_text("".join(l + "\n" for l in lines))
    return dst


def test_one_step_one_composition_is_inconclusive(clean, tmp_path):
    recs = load_records(_copy_without(clean, tmp_path / "r", lambda r: r.get("step") == 2 or
                                      r.get("composition") == "alone"))
    with pytest.raises(judge.Inconclusive, match="1 RL step"):
        judge.judge_two_steps(recs)
    with pytest.raises(judge.Inconclusive, match="only one composition"):
        judge.judge_composition(recs)


def test_small_steps_are_inconclusive(tmp_path):
    with RecordWriter(tmp_path) as w:
        w.rollout(step=1, id="a", prompt_ids=[1, 2], token_ids=[3], logprobs=[-1.5], sampling={"temperature": 1.0},
                  weight_version=0)
        w.trainer_pass(step=1, composition="x", weight_version=0, layout="packed", micro_batches=[["a"]],
                       logprobs={"a": np.array([-1.5], np.float32)})
    with pytest.raises(judge.Inconclusive, match="256 tokens"):
        judge.judge_parity(load_records(tmp_path))


def test_composition_below_256_tokens_is_inconclusive(tmp_path):
    with RecordWriter(tmp_path) as w:
        for sid in ("a", "b"):
            w.rollout(step=1, id=sid, prompt_ids=[1, 2], token_ids=[3], logprobs=[-1.5], sampling={"temperature": 1.0},
                      weight_version=0)
        lps = {"a": np.array([-1.5], np.float32), "b": np.array([-1.5], np.float32)}
        w.trainer_pass(step=1, composition="packed", weight_version=0, layout="packed", micro_batches=[["a", "b"]],
                       logprobs=lps)
        w.trainer_pass(step=1, composition="alone", weight_version=0, layout="packed", micro_batches=[["a"], ["b"]],
                       logprobs=lps)
    with pytest.raises(judge.Inconclusive, match="256 tokens"):
        judge.judge_composition(load_records(tmp_path))


# ---------------------------------------------------------------------------------------------
# module output dumps: a red C7 names the first module whose outputs differ
# ---------------------------------------------------------------------------------------------
MODULES = ("model.embed_tokens", "model.layers.0", "model.layers.1.mlp", "model.norm")


def _dumped(tmp_path, *, differ_at: str | None, trainer_names=MODULES) -> Path:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    engine_out = {m: torch.randn(300, 16, generator=gen).to(torch.bfloat16) for m in MODULES}
    trainer_out = {m: engine_out[m].clone() for m in trainer_names if m in engine_out}
    if differ_at:
        t = trainer_out[differ_at]
        t.view(-1)[37] = torch.nextafter(t.view(-1)[37:38].float(), torch.tensor([9.0])).to(torch.bfloat16)
        if t.view(-1)[37] == engine_out[differ_at].view(-1)[37]:        # float32 step below bf16's ULP: take bf16's
            t.view(torch.int16).view(-1)[37] += 1
    lps = np.full(40, -1.25, np.float32)
    off = lps.copy()
    off[3] = np.nextafter(off[3], np.float32(0))
    with RecordWriter(tmp_path) as w:
        w.rollout(step=1, id="s", prompt_ids=list(range(260)), token_ids=list(range(40)), logprobs=lps,
                  sampling={"temperature": 1.0}, weight_version=0, engine={"step_tokens": [300]})
        w.trainer_pass(step=1, composition="packed", weight_version=0, layout="packed", micro_batches=[["s"]],
                       logprobs={"s": off})
        w.module_outputs(step=1, id="s", side="engine", outputs=engine_out)
        w.module_outputs(step=1, id="s", side="trainer", outputs=trainer_out)
    return tmp_path


def test_red_parity_names_the_first_diverging_module(tmp_path):
    with pytest.raises(AssertionError) as err:
        judge.judge_parity(load_records(_dumped(tmp_path, differ_at="model.layers.1.mlp")))
    text = str(err.value)
    assert "first diverging op: module model.layers.1.mlp" in text, text
    assert "the 2 before it bitwise equal" in text and "element 37 of 4800" in text and "1 ULP apart" in text, text


def test_equal_dumps_say_the_difference_comes_after_them(tmp_path):
    with pytest.raises(AssertionError, match="after model.norm: the 4 modules both sides dumped"):
        judge.judge_parity(load_records(_dumped(tmp_path, differ_at=None)))


def test_bad_module_dumps_are_one_line(tmp_path):
    d = _dumped(tmp_path, differ_at=None, trainer_names=MODULES[:2])
    index = d / "rank-00000" / "records.jsonl"
    lines = index.read_text().splitlines()
    rec = json.loads(lines[-1])
    rec["dtypes"]["model.layers.0"] = "float32"             # its bits are bfloat16's int16
    index.write_text("\n".join(lines[:-1] + [json.dumps(rec)]) + "\n")
    with pytest.raises(RecordsError, match="module/model.layers.0: stored as int16, not the int32 bits of float32"):
        load_records(d)


def test_plan_not_followed_reads_incomplete(clean, tmp_path):
    rec = _copy_without(clean, tmp_path / "r", lambda r: r.get("composition") == "alone" and r.get("step") == 2)
    res = run_pytest(f"--records={rec}", "-m", "C6", "-rs")
    assert res.returncode == 0 and "INCOMPLETE" in res.stdout, res.stdout[-2000:]
    assert "do not follow the plan" in res.stdout and "composition 'alone'" in res.stdout, res.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# bad records: one line naming the file and the field, exit 4
# ---------------------------------------------------------------------------------------------
def _edit_line(path: Path, n: int, edit) -> None:
    lines = path.read_text().splitlines()
    lines[n] = edit(lines[n])
    path.write_text("".join(l + "\n" for l in lines))


def _field(key, value):
    def edit(line):
        rec = json.loads(line)
        if value is KeyError:
            rec.pop(key)
        else:
            rec[key] = value
        return json.dumps(rec)
    return edit


BAD = {
    "missing field": (lambda d: _edit_line(d / "records.jsonl", 2, _field("token_ids", KeyError)),
                      ["records.jsonl:3", "token_ids", "missing"]),
    "wrong length": (lambda d: _edit_line(d / "records.jsonl", 2, lambda l: json.dumps(
        {**json.loads(l), "token_ids": json.loads(l)["token_ids"] + [1]})), ["records.jsonl:3", "logprobs", "for"]),
    "NaN": (lambda d: _edit_line(d / "records.jsonl", 2, lambda l: l.replace('"temperature": 1.0', '"temperature": NaN')),
            ["records.jsonl:3", "NaN"]),
    "mismatched id": (lambda d: (d / "records.jsonl").write_text((d / "records.jsonl").read_text().replace(
        '["p0#0"]', '["p9#9"]')), ["micro_batches", "p9#9", "no rollout record"]),
    "truncated index": (lambda d: (d / "records.jsonl").write_text((d / "records.jsonl").read_text()[:-40]),
                        ["records.jsonl", "truncated last line"]),
    "truncated tensors": (lambda d: (d / "tensors" / "000003.safetensors").write_bytes(
        (d / "tensors" / "000003.safetensors").read_bytes()[:30]), ["000003.safetensors", "tensors", "truncated"]),
    "unknown version": (lambda d: (d / "manifest.json").write_text(json.dumps(
        {**json.loads((d / "manifest.json").read_text()), "version": 99})), ["manifest.json", "version", "99"]),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_records_are_one_line_and_exit_4(clean, tmp_path, kind):
    shutil.copytree(clean, tmp_path / "r")
    spoil, needles = BAD[kind]
    spoil(tmp_path / "r" / "rank-00000")
    with pytest.raises(RecordsError) as err:        # the reader says it ...
        load_records(tmp_path / "r")
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    if kind in ("missing field", "truncated tensors"):    # ... and pytest makes it one line, exit 4 (two kept: seconds each)
        res = run_pytest(f"--records={tmp_path / 'r'}", "-m", "C7")
        lines = [l for l in res.stderr.splitlines() if l.strip()]
        assert res.returncode == 4 and len(lines) == 1 and lines[0].startswith("ERROR: --records"), res.stderr
        assert "Traceback" not in res.stdout + res.stderr


def test_a_crashed_writer_leaves_a_readable_prefix(tmp_path):
    with RecordWriter(tmp_path, rank=1) as w:
        w.weights(0, {"w": "ab"}, side="trainer")
        w.rollout(step=1, id="a", prompt_ids=[1], token_ids=[2, 3], logprobs=np.array([-1.0, -2.0], np.float32),
                  sampling={"temperature": 1.0}, weight_version=0)
    shard = tmp_path / "rank-00001"
    (shard / "records.jsonl").open("a").write('{"kind": "rollout", "st')     # the crash, mid-line
    text = (shard / "records.jsonl").read_text()
    prefix = text[: text.rindex("\n") + 1]
    assert len(prefix.splitlines()) == 2 and all(json.loads(l) for l in prefix.splitlines())
    with pytest.raises(RecordsError, match="truncated last line"):
        load_records(tmp_path)


def test_writer_refuses_other_float_widths(tmp_path):
    torch = pytest.importorskip("torch")
    with RecordWriter(tmp_path) as w, pytest.raises(TypeError, match="float32"):
        w.rollout(step=1, id="a", prompt_ids=[1], token_ids=[2], logprobs=torch.zeros(1, dtype=torch.bfloat16),
                  sampling={"temperature": 1.0}, weight_version=0)


def test_writer_imports_neither_torch_distributed_nor_vllm():
    code = ("import sys, fixtures.records.writer; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_torchrun_example_judges_green(tmp_path):
    """examples/records_torchrun.py: two gloo ranks, their own data-parallel loop, records judged green."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # its own process group: a timeout ends the launcher and both ranks, no orphan holds the port
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "examples/records_torchrun.py", str(tmp_path)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail("the two-rank example did not finish in 240 s:\n" + out[-2000:] + err[-3000:])
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert sorted(p.name for p in (tmp_path / "records").glob("rank-*")) == ["rank-00000", "rank-00001"]
    res = run_pytest(f"--records={tmp_path / 'records'}", "--strict-gates", "-m", "C6 or C7 or C9")
    rows = verdict_rows(res.stdout)
    assert res.returncode == 0 and rows.get("C6") == rows.get("C7") == rows.get("C9") == "PASS", res.stdout[-2000:]


def test_the_drive_command_writes_records_pytest_judges_green(tmp_path):
    """`python -m fixtures.records.drive` (the command a GPU run uses with --impl vllm-engine-kernels)
    on the reference stack: its records judge green; a bad --model is one line, exit 4."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "fixtures.records.drive", "--impl", "reference", "--model", "llama",
                          "--out", str(tmp_path / "r")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "records written" in run.stdout, run.stdout + run.stderr
    res = run_pytest(f"--records={tmp_path / 'r'}", "--strict-gates", "-m", "C6 or C7 or C9")
    assert res.returncode == 0 and verdict_rows(res.stdout).get("C7") == "PASS", res.stdout[-2000:]
    bad = subprocess.run([sys.executable, "-m", "fixtures.records.drive", "--model", "no/such/dir", "--out",
                          str(tmp_path / "x")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4 and bad.stderr.startswith("ERROR: --model no/such/dir") and \
        len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_the_drive_command_says_not_run_in_one_line_where_the_stack_cannot_run(tmp_path):
    """The vLLM implementation on a machine without CUDA: one line naming why, exit 3, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "fixtures.records.drive", "--impl", "vllm-engine-kernels", "--model",
                          "llama", "--out", str(tmp_path / "r")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 3 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith("NOT RUN: n/a:"), run.stderr[-2000:]


def test_a_records_run_names_no_chain_it_could_not_run(clean):
    res = run_pytest(f"--records={clean}", "-m", "C7")
    assert res.returncode == 0 and verdict_rows(res.stdout).get("C7") == "PASS", res.stdout[-2000:]
    assert "earlier gates not run" not in res.stdout, res.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# optional top-k rows: compared where both sides recorded them
# ---------------------------------------------------------------------------------------------
def _with_topk(tmp_path, *, trainer_ids=None, trainer_lps=None) -> Path:
    ids = np.array([[5, 9, 2]] * 40, np.int64)
    lps = np.tile(np.array([-0.5, -1.5, -2.25], np.float32), (40, 1))
    sampled = np.full(40, -0.5, np.float32)
    with RecordWriter(tmp_path) as w:
        w.rollout(step=1, id="s", prompt_ids=list(range(260)), token_ids=[5] * 40, logprobs=sampled,
                  sampling={"temperature": 1.0}, weight_version=0, engine={"step_tokens": [300]}, topk=(ids, lps))
        w.trainer_pass(step=1, composition="packed", weight_version=0, layout="packed", micro_batches=[["s"]],
                       logprobs={"s": sampled}, topk={"s": (ids if trainer_ids is None else trainer_ids,
                                                          lps if trainer_lps is None else trainer_lps)})
    return tmp_path


def test_topk_rows_are_compared_where_both_sides_recorded_them(tmp_path):
    assert judge.judge_parity(load_records(_with_topk(tmp_path / "same")))["topk_rows_compared"] == 40
    lps = np.tile(np.array([-0.5, -1.5, -2.25], np.float32), (40, 1))
    lps[7, 2] = np.nextafter(lps[7, 2], np.float32(0))
    with pytest.raises(AssertionError, match="top-k logprobs.*\\n.*1 ULP apart"):
        judge.judge_parity(load_records(_with_topk(tmp_path / "ulp", trainer_lps=lps)))
    ids = np.array([[5, 9, 2]] * 40, np.int64)
    ids[3] = [5, 2, 9]
    with pytest.raises(AssertionError, match="top-k token ids"):
        judge.judge_parity(load_records(_with_topk(tmp_path / "order", trainer_ids=ids)))


def test_bad_topk_rows_are_one_line(tmp_path):
    d = _with_topk(tmp_path)
    index = d / "rank-00000" / "records.jsonl"
    first, *rest = index.read_text().splitlines()
    index.write_text("\n".join([json.dumps({**json.loads(first), "topk": 4})] + rest) + "\n")
    with pytest.raises(RecordsError, match="topk_ids: expected int64 \\[40, 4\\], got int64 \\[40, 3\\]"):
        load_records(d)
