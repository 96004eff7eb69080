"""The vLLM adapter (fixtures.vllm: settings, convert, client, pool, implementation, worker)
without vLLM: the settings and sampling mappings, RequestOutput -> Completion on objects shaped
like vLLM 0.26's, the worker protocol end to end through the worker's fake backend (errors,
crashes and hangs come back as clear exceptions), engine reuse, and the "n/a" skip where vLLM or
CUDA is missing. The tests marked gpu/vllm run the real engine and skip with a one-line reason
elsewhere."""
from __future__ import annotations

import json
import os
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from fixtures.vllm import client as vclient
from fixtures.vllm import convert as vconv
from fixtures.vllm import implementation as vimpl
from fixtures.vllm import ipc as vipc
from fixtures.vllm import pool as vpool
from fixtures.vllm import settings as vset
from fixtures.core.contract import ContractError, EngineSettings, Request, SamplingParams

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

# shaped like vLLM 0.26: vllm/outputs.py RequestOutput / CompletionOutput, vllm/logprobs.py Logprob
Logprob = namedtuple("Logprob", "logprob rank decoded_token")
CompletionOutput = namedtuple("CompletionOutput", "index text token_ids cumulative_logprob logprobs finish_reason "
                                                  "stop_reason")
RequestOutput = namedtuple("RequestOutput", "request_id prompt prompt_token_ids prompt_logprobs outputs finished "
                                            "num_cached_tokens")


class FlatLike:
    """A FlatLogprobs stand-in: positions read through __getitem__ as {token: Logprob}."""

    def __init__(self, positions):
        self.token_ids = [t for p in positions for t in p]
        self.logprobs = [v for p in positions for v in p.values()]
        self.bounds = []
        start = 0
        for p in positions:
            self.bounds.append((start, start + len(p)))
            start += len(p)

    def __len__(self):
        return len(self.bounds)

    def __getitem__(self, i):
        a, b = self.bounds[i]
        return {self.token_ids[k]: Logprob(self.logprobs[k], 1, None) for k in range(a, b)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory the fake worker accepts: config.json is all it reads."""
    d = tmp_path_factory.mktemp("fake-model")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    return d


# ---------------------------------------------------------------------------------------------
# EngineSettings -> LLM kwargs, worker env
# ---------------------------------------------------------------------------------------------
def test_default_kwargs(model_dir):
    kw = vset.llm_kwargs(model_dir, EngineSettings())
    assert kw["model"] == str(model_dir)
    assert kw["skip_tokenizer_init"] is True and kw["logprobs_mode"] == "raw_logprobs" and kw["dtype"] == "bfloat16"
    assert kw["enforce_eager"] is True and "compilation_config" not in kw
    assert kw["attention_config"] == {"backend": "FLASH_ATTN"}
    assert (kw["enable_prefix_caching"], kw["enable_chunked_prefill"], kw["async_scheduling"]) == (True, True, True)
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"]) == (256, 8192, 2048)
    assert "num_gpu_blocks_override" not in kw and kw["kv_cache_memory_bytes"] == 4 << 30
    assert kw["tensor_parallel_size"] == 1


@pytest.mark.parametrize("graphs, compiled, expect", [
    (False, False, {"enforce_eager": True}),
    (False, True, {"enforce_eager": False, "compilation_config": {"mode": "VLLM_COMPILE", "cudagraph_mode": "NONE"}}),
    (True, False, {"enforce_eager": False, "compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL"}}),
    (True, True, {"enforce_eager": False, "compilation_config": {"mode": "VLLM_COMPILE",
                                                                 "cudagraph_mode": "FULL_AND_PIECEWISE"}}),
])
def test_graphs_and_compilation_vary_separately(model_dir, graphs, compiled, expect):
    kw = vset.llm_kwargs(model_dir, EngineSettings(cuda_graphs=graphs, compilation=compiled))
    assert {k: kw[k] for k in expect} == expect
    if not compiled or not graphs:
        assert "compilation_config" not in kw or kw["compilation_config"]["cudagraph_mode"] != "PIECEWISE"


@pytest.mark.parametrize("settings, expect", [
    (EngineSettings(max_num_batched_tokens=5), {"max_num_batched_tokens": 5, "max_num_seqs": 5}),
    (EngineSettings(enable_chunked_prefill=False, max_num_batched_tokens=1024),
     {"enable_chunked_prefill": False, "max_model_len": 1024, "max_num_seqs": 256}),
    (EngineSettings(kv_cache_blocks=12), {"num_gpu_blocks_override": 12, "max_model_len": 192}),
    (EngineSettings(max_num_seqs=3), {"max_num_seqs": 3, "max_num_batched_tokens": 8192}),
    (EngineSettings(enable_prefix_caching=False, async_scheduling=False),
     {"enable_prefix_caching": False, "async_scheduling": False}),
    (EngineSettings(attention_backend="TRITON_ATTN"), {"attention_config": {"backend": "TRITON_ATTN"}}),
    (EngineSettings(extra={"llm_kwargs": {"block_size": 32}, "max_model_len": 4096}),
     {"block_size": 32, "max_model_len": 4096}),
])
def test_settings_map_to_kwargs_vllm_accepts(model_dir, settings, expect):
    """Including the adjustments vLLM's validation forces (budget >= max_num_seqs, ...)."""
    kw = vset.llm_kwargs(model_dir, settings)
    assert {k: kw[k] for k in expect} == expect
    assert kw["max_num_batched_tokens"] >= kw["max_num_seqs"]
    if not kw["enable_chunked_prefill"]:
        assert kw["max_num_batched_tokens"] >= kw["max_model_len"]


def test_compiled_custom_ops_knob_and_nested_extra(model_dir):
    from dataclasses import replace
    same_kernels = replace(vset.EAGER_DEFAULTS, compiled_custom_ops=("all",))
    kw = vset.llm_kwargs(model_dir, EngineSettings(compilation=True), same_kernels)
    assert kw["compilation_config"] == {"mode": "VLLM_COMPILE", "cudagraph_mode": "NONE", "custom_ops": ["all"]}
    assert "custom_ops" not in vset.llm_kwargs(model_dir, EngineSettings(cuda_graphs=True), same_kernels)["compilation_config"]
    assert vset.llm_kwargs(model_dir, EngineSettings(), same_kernels) == vset.llm_kwargs(model_dir, EngineSettings())
    kw = vset.llm_kwargs(model_dir, EngineSettings(cuda_graphs=True, extra={"llm_kwargs": {
        "compilation_config": {"cudagraph_capture_sizes": [1, 2]}}}))
    assert kw["compilation_config"] == {"mode": "NONE", "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2]}


def test_compiled_custom_ops_from_env(monkeypatch):
    monkeypatch.setenv("CONFORMANCE_VLLM_COMPILED_CUSTOM_OPS", "all")
    impl = vimpl.VLLMImplementation()
    assert impl.defaults.compiled_custom_ops == ("all",) and "custom_ops=['all']" in impl.describe()["engine_defaults"]


def test_same_configuration_same_key(model_dir):
    explicit = EngineSettings(enable_prefix_caching=True, enable_chunked_prefill=True, cuda_graphs=False,
                              compilation=False, async_scheduling=True, max_num_seqs=256, attention_backend="FLASH_ATTN")
    assert vset.engine_key(model_dir, EngineSettings()) == vset.engine_key(model_dir, explicit)
    others = [EngineSettings(batch_invariant=False), EngineSettings(max_num_seqs=3), EngineSettings(cuda_graphs=True),
              EngineSettings(extra={"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}})]
    keys = {vset.engine_key(model_dir, s) for s in [EngineSettings()] + others}
    assert len(keys) == 1 + len(others)


@pytest.mark.parametrize("invariant", [True, False])
def test_worker_env_is_prepared_before_vllm_import(invariant):
    env = vipc.worker_env(EngineSettings(batch_invariant=invariant), base={"PYTHONPATH": "/tmp/site", "HOME": "/root",
                                                                          "VLLM_BATCH_INVARIANT": "1"})
    assert env["VLLM_BATCH_INVARIANT"] == ("1" if invariant else "0")
    for k, v in {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                 "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}.items():
        assert env[k] == v, k
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site"] and env["HOME"] == "/root"
    assert vipc.FAKE_ENV not in env


# ---------------------------------------------------------------------------------------------
# SamplingParams -> vLLM SamplingParams kwargs
# ---------------------------------------------------------------------------------------------
def test_greedy_sampled_logprobs_only():
    kw = vconv.sampling_kwargs(SamplingParams(max_tokens=4))
    assert kw["logprobs"] == 0 and kw["prompt_logprobs"] is None and kw["skip_reading_prefix_cache"] is False
    assert (kw["temperature"], kw["seed"], kw["n"], kw["max_tokens"], kw["ignore_eos"]) == (0.0, None, 1, 4, True)
    assert kw["detokenize"] is False and "stop_token_ids" not in kw


def test_prompt_logprobs_skip_the_prefix_cache():
    """vLLM has no logits for prompt positions read from the cache, so those requests skip it."""
    kw = vconv.sampling_kwargs(SamplingParams(), want_prompt_logprobs=True)
    assert kw["prompt_logprobs"] == 0 and kw["skip_reading_prefix_cache"] is True


@pytest.mark.parametrize("params, expect", [
    (SamplingParams(temperature=1.0), {"seed": 0}),
    (SamplingParams(temperature=0.7, seed=42, n=4), {"seed": 42, "n": 4, "temperature": 0.7}),
    (SamplingParams(temperature=1.3, top_k=20), {"top_k": 20, "top_p": 1.0}),
    (SamplingParams(temperature=0.5, top_p=0.5, top_k=7), {"top_k": 7, "top_p": 0.5}),
    (SamplingParams(ignore_eos=False), {"ignore_eos": False, "stop_token_ids": [7]}),
])
def test_sampling_mapping(params, expect):
    kw = vconv.sampling_kwargs(params, eos_ids=(7,))
    assert {k: kw[k] for k in expect} == expect


def test_temperature_beyond_vllm_range_is_refused():
    with pytest.raises(ValueError, match=r"accepts \[0, 2.0\]"):
        vconv.sampling_kwargs(SamplingParams(temperature=2.5))


def test_eos_ids_from_config():
    assert vconv.eos_token_ids({"eos_token_id": [1, 2]}) == (1, 2)
    assert vconv.eos_token_ids({"eos_token_id": 5}) == (5,) and vconv.eos_token_ids({}) == ()


@pytest.mark.vllm
def test_vllm_accepts_the_sampling_kwargs():
    pytest.importorskip("vllm", reason="n/a: vLLM is not installed")
    from vllm import SamplingParams as VSP
    sp = VSP(**vconv.sampling_kwargs(SamplingParams(temperature=1.0, top_p=0.8, n=2), want_prompt_logprobs=True))
    assert sp.logprobs == 0 and sp.prompt_logprobs == 0 and sp.skip_reading_prefix_cache is True and sp.seed == 0


# ---------------------------------------------------------------------------------------------
# RequestOutput -> Completion
# ---------------------------------------------------------------------------------------------
def _f32(x: float) -> float:
    return torch.tensor([x], dtype=torch.float32).item()      # a float32 value as vLLM hands it over


def _output(prompt, samples, *, prompt_lps=None, cached=3, rid="0"):
    outs = [CompletionOutput(i, "", toks, None, [{t: Logprob(lp, 1, None), 99: Logprob(-0.5, 1, None)}
                                                 for t, lp in zip(toks, lps)], "length", None)
            for i, (toks, lps) in enumerate(samples)]
    return RequestOutput(rid, None, list(prompt), prompt_lps, list(reversed(outs)), True, cached)


def test_conversion_is_exact_and_ordered():
    prompt = (5, 6, 7, 8)
    a, b = [_f32(-1.2345678), _f32(-0.1)], [_f32(-3.3), _f32(-7.77)]
    plp = [None] + [{t: Logprob(_f32(-1.0 - t / 7), 1, None)} for t in prompt[1:]]
    req = Request("r", prompt, SamplingParams(n=2, max_tokens=2, temperature=1.0), want_prompt_logprobs=True)
    c = vconv.completion_from_output(req, _output(prompt, [([11, 12], a), ([13, 14], b)], prompt_lps=plp))
    assert [s.token_ids for s in c.samples] == [[11, 12], [13, 14]]
    assert torch.equal(c.samples[0].logprobs, torch.tensor(a, dtype=torch.float32))
    assert torch.equal(c.samples[1].logprobs, torch.tensor(b, dtype=torch.float32))
    assert c.samples[0].logprobs.dtype == torch.float32 and c.samples[0].processed_logprobs is None
    assert torch.equal(c.prompt_logprobs, torch.tensor([_f32(-1.0 - t / 7) for t in prompt[1:]], dtype=torch.float32))
    assert c.num_cached_tokens == 3 and c.prompt_ids == prompt and c.request_id == "r"


def test_conversion_reads_flat_logprobs():
    req = Request("r", (1, 2, 3), SamplingParams(max_tokens=2), want_prompt_logprobs=True)
    out = RequestOutput("0", None, [1, 2, 3], FlatLike([{}, {2: -1.5}, {3: -2.5}]),
                        [CompletionOutput(0, "", [4, 5], None, FlatLike([{4: -0.25, 9: -1.0}, {5: -0.75}]), "length",
                                          None)], True, None)
    c = vconv.completion_from_output(req, out)
    assert c.samples[0].logprobs.tolist() == [-0.25, -0.75] and c.prompt_logprobs.tolist() == [-1.5, -2.5]
    assert c.num_cached_tokens == 0


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o._replace(outputs=o.outputs[:1]), "samples"),
    (lambda o: o._replace(prompt_token_ids=[1, 2]), "prompt ids"),
    (lambda o: o._replace(outputs=[x._replace(logprobs=x.logprobs[:1]) for x in o.outputs]), "logprob positions"),
    (lambda o: o._replace(outputs=[x._replace(logprobs=[{}, {}]) for x in o.outputs]), "missing"),
    (lambda o: o._replace(prompt_logprobs=[None, {6: Logprob(-1.0, 1, None)}]), "prompt logprob positions"),
    (lambda o: o._replace(outputs=[x._replace(logprobs=[{t: Logprob(0.5, 1, None)} for t in x.token_ids])
                                   for x in o.outputs]), "<= 0"),
])
def test_conversion_names_the_breach(mutate, message):
    prompt = (5, 6, 7)
    plp = [None] + [{t: Logprob(-1.0, 1, None)} for t in prompt[1:]]
    out = _output(prompt, [([1, 2], [-1.0, -2.0]), ([3, 4], [-1.0, -2.0])], prompt_lps=plp)
    req = Request("r", prompt, SamplingParams(n=2, max_tokens=2, temperature=1.0), want_prompt_logprobs=True)
    with pytest.raises(ContractError, match=message):
        vconv.completion_from_output(req, mutate(out))


# ---------------------------------------------------------------------------------------------
# capabilities and the resolution check
# ---------------------------------------------------------------------------------------------
def _info(**over):
    info = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "async_scheduling": True,
            "max_num_seqs": 256, "max_num_batched_tokens": 8192, "batch_invariant": True, "cudagraph_mode": "NONE",
            "compilation_mode": "NONE", "num_gpu_blocks": 4096, "attention_backends": ["FLASH_ATTN"],
            "probes": ["scheduler", "graphs", "compilation"]}
    info.update(over)
    return info


def test_capabilities_follow_the_probes_and_the_resolved_config():
    caps = vset.capabilities_from_info(_info())
    assert caps.prefix_cache and caps.chunked_prefill and caps.preemption and caps.cuda_graphs
    assert caps.compilation and caps.async_scheduling and caps.top_p and caps.top_k and caps.n_samples
    assert caps.prompt_logprobs and caps.seeded_sampling and not caps.weight_update
    assert vset.capabilities_from_info(_info(probes=["reload"])).weight_update     # the runner has reload_weights
    bare = vset.capabilities_from_info(_info(probes=[], enable_prefix_caching=False))
    assert not (bare.prefix_cache or bare.chunked_prefill or bare.preemption or bare.cuda_graphs or bare.compilation
                or bare.async_scheduling)


@pytest.mark.parametrize("settings, info, message", [
    (EngineSettings(cuda_graphs=True), _info(cudagraph_mode="NONE"), "cuda_graphs: asked True"),
    (EngineSettings(), _info(cudagraph_mode="FULL"), "cuda_graphs: asked False"),
    (EngineSettings(compilation=True), _info(), "compilation: asked True"),
    (EngineSettings(enable_chunked_prefill=False, max_num_batched_tokens=1024),
     _info(max_num_batched_tokens=1024), "enable_chunked_prefill"),
    (EngineSettings(kv_cache_blocks=12), _info(), "kv_cache_blocks"),
    (EngineSettings(batch_invariant=False), _info(), "batch_invariant"),
    (EngineSettings(attention_backend="TRITON_ATTN"), _info(), "attention_backend"),
])
def test_resolution_mismatches_are_named(settings, info, message):
    bad = vset.resolution_mismatches(vset.effective_settings(settings), info)
    assert any(message in b for b in bad), bad


def test_honest_resolution_passes():
    eff = vset.effective_settings(EngineSettings(cuda_graphs=True, compilation=True))
    assert vset.resolution_mismatches(eff, _info(cudagraph_mode="FULL_AND_PIECEWISE", compilation_mode="VLLM_COMPILE")) == []


# ---------------------------------------------------------------------------------------------
# the worker protocol, through the fake backend
# ---------------------------------------------------------------------------------------------
def _reqs():
    shared = list(range(100, 140))
    return [Request("a", tuple(shared + [1, 2]), SamplingParams(max_tokens=3)),
            Request("b", tuple(range(3, 9)), SamplingParams(max_tokens=2, temperature=1.0, seed=4, n=3)),
            Request("c", tuple(shared + [5]), SamplingParams(max_tokens=1), want_prompt_logprobs=True)]


@pytest.mark.parametrize("invariant", [True, False])
def test_worker_round_trip(model_dir, invariant, tmp_path):
    settings = EngineSettings(batch_invariant=invariant, max_num_seqs=7)
    with vclient.VLLMEngine(model_dir, settings, fake="echo", log_dir=tmp_path) as eng:
        assert eng.info["env"]["VLLM_BATCH_INVARIANT"] == ("1" if invariant else "0")
        assert eng.info["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert eng.info["llm_kwargs"] == vset.llm_kwargs(model_dir, settings)
        assert eng.capabilities().prefix_cache and eng.name == "vllm-fake"
        out = eng.generate(_reqs())
        assert [c.request_id for c in out] == ["a", "b", "c"]
        assert [len(c.samples) for c in out] == [1, 3, 1] and [len(s.token_ids) for s in out[1].samples] == [2, 2, 2]
        assert out[1].samples[0].token_ids != out[1].samples[1].token_ids      # seed + index per sample
        assert out[2].prompt_logprobs.shape == (len(_reqs()[2].prompt_ids) - 1,) and out[0].prompt_logprobs is None
        assert eng.last_stats().max_running == 5 and eng.last_stats().extra["fake"]
        lps = eng.prompt_logprobs([[1, 2, 3], [4]])
        assert [t.shape[0] for t in lps] == [2, 0] and all(t.dtype == torch.float32 for t in lps)
        proc = eng.proc
    assert proc.poll() is not None, "close() must end the worker process"


def test_prefix_cache_evidence_and_reset(model_dir, tmp_path):
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path) as eng:
        a, b, c = _reqs()
        assert eng.generate([a])[0].num_cached_tokens == 0
        hit = eng.generate([Request("b2", a.prompt_ids[:40] + (9, 9), SamplingParams())])[0]
        assert hit.num_cached_tokens == 32 and eng.last_stats().cached_prompt_tokens == 32
        assert eng.generate([c])[0].num_cached_tokens == 0        # prompt logprobs: never read from the cache
        assert eng.reset_prefix_cache()
        assert eng.generate([Request("b3", a.prompt_ids[:40] + (9,), SamplingParams())])[0].num_cached_tokens == 0


def test_worker_errors_come_back_with_traceback(model_dir, tmp_path):
    with vclient.VLLMEngine(model_dir, fake="error_generate", log_dir=tmp_path) as eng:
        with pytest.raises(vipc.VLLMWorkerError, match="ValueError: fake generate failure") as info:
            eng.generate(_reqs())
        assert "worker traceback" in str(info.value) and "fixtures/vllm/fake_backend.py" in str(info.value)
        assert "in generate" in str(info.value)
        assert eng.alive, "an error reply leaves the worker usable"


def test_start_failure_is_clear_and_leaves_no_process(model_dir, tmp_path, monkeypatch):
    started = []
    real_popen = vipc.subprocess.Popen
    monkeypatch.setattr(vipc.subprocess, "Popen", lambda *a, **k: started.append(real_popen(*a, **k)) or started[-1])
    with pytest.raises(vipc.VLLMWorkerError, match="engine start raised RuntimeError: fake start failure"):
        vclient.VLLMEngine(model_dir, fake="fail_start", log_dir=tmp_path)
    assert started and started[0].poll() is not None


def test_hang_times_out_and_kills(model_dir, tmp_path):
    eng = vclient.VLLMEngine(model_dir, fake="hang_generate", log_dir=tmp_path, call_timeout=3)
    t0 = time.monotonic()
    with pytest.raises(vipc.VLLMWorkerTimeout, match="no answer within 3 s"):
        eng.generate(_reqs())
    assert time.monotonic() - t0 < 30 and eng.proc.poll() is not None and not eng.alive
    with pytest.raises(vipc.VLLMWorkerError, match="unusable"):
        eng.generate(_reqs())
    eng.close()


def test_crash_is_reported_with_exit_code_and_log(model_dir, tmp_path):
    eng = vclient.VLLMEngine(model_dir, fake="crash_generate", log_dir=tmp_path)
    with pytest.raises(vipc.VLLMWorkerError, match="exited without answering") as info:
        eng.generate(_reqs())
    assert "exit code 7" in str(info.value) and "fake worker crashing now" in str(info.value)
    eng.close()


def test_unresolved_mode_fails_at_start(model_dir, tmp_path, monkeypatch):
    """An engine never claims a mode vLLM did not resolve (here: graphs asked, NONE resolved)."""
    monkeypatch.setattr(vclient, "resolution_mismatches", lambda eff, info: ["cuda_graphs: asked True, vLLM resolved NONE"])
    with pytest.raises(vset.VLLMResolutionError, match="cuda_graphs: asked True"):
        vclient.VLLMEngine(model_dir, EngineSettings(cuda_graphs=True), fake="echo", log_dir=tmp_path)


def test_generate_validates_input(model_dir, tmp_path):
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path) as eng:
        with pytest.raises(ValueError, match="empty prompt"):
            eng.generate([Request("e", (), SamplingParams())])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.generate([Request("v", (1000,), SamplingParams())])
        assert eng.generate([]) == []


# ---------------------------------------------------------------------------------------------
# the implementation: n/a where vLLM or CUDA is missing, engine reuse
# ---------------------------------------------------------------------------------------------
def test_make_engine_without_vllm_is_na(model_dir, monkeypatch):
    monkeypatch.setattr(vimpl, "vllm_version", lambda: None)
    with pytest.raises(NotImplementedError, match=r"^n/a: vLLM is not installed \(pip install vllm==0\.26\.0"):
        vimpl.VLLMImplementation().make_engine(model_dir)


def test_make_engine_without_cuda_is_na(model_dir, monkeypatch):
    monkeypatch.setattr(vimpl, "vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NotImplementedError, match="^n/a: vLLM needs a CUDA device"):
        vimpl.VLLMImplementation().make_engine(model_dir)


def test_engine_factory_turns_na_into_a_skip(pytester, monkeypatch):
    monkeypatch.setattr(vimpl, "vllm_version", lambda: None)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_engine="""
def test_engine(engine_factory):
    with engine_factory() as e:
        e.generate([])
""")
    res = pytester.runpytest_inprocess("--impl", "vllm", "--model", "llama", "--proxy", "tiny", "-p", "no:cacheprovider",
                                       "-rs")
    res.assert_outcomes(skipped=1)
    assert "SKIPPED [1] conftest.py" in res.stdout.str() and "n/a: vLLM is not installed (pip install vllm==0.26.0" in res.stdout.str()


def test_describe_does_not_import_vllm():
    before = "vllm" in sys.modules
    d = vimpl.VLLMImplementation().describe()
    assert {"impl", "engine", "attention_backend", "VLLM_BATCH_INVARIANT", "dtype", "device"} <= set(d)
    assert d["attention_backend"] == "FLASH_ATTN" and d["dtype"] == "bfloat16"
    assert ("vllm" in sys.modules) == before


def test_builtin_name_and_factories():
    from fixtures.core.loader import load_implementation
    assert isinstance(load_implementation("vllm"), vimpl.VLLMImplementation)
    assert vimpl.triton_attn().defaults.attention_backend == "TRITON_ATTN"
    assert vimpl.native_defaults().defaults.cuda_graphs and vimpl.native_defaults().defaults.compilation


def test_default_kv_cache_is_sized_by_the_model(tmp_path):
    """A default engine's KV cache holds AdapterDefaults.kv_cache_tokens tokens of its model (bf16
    K and V per attention layer), at most the 4 GiB cap: a shallow proxy's engine no longer
    reserves 4 GiB it cannot use (measured on the H200: 9.5 GiB per qwen3-shallow engine, four
    workers out of memory). Full depth, latent attention and state-space layers keep the cap;
    an explicit EngineSettings.extra value is kept as given."""
    def model(**config):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, **config}))
        return d
    shallow = model(num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    assert vset.kv_cache_bytes(shallow) == 2 * 2 * 8 * 128 * 2 * 262144 == 2 << 30
    assert vset.llm_kwargs(shallow, EngineSettings())["kv_cache_memory_bytes"] == 2 << 30
    assert vset.llm_kwargs(shallow, EngineSettings(extra={"kv_cache_memory_bytes": 3 << 30}))["kv_cache_memory_bytes"] \
        == 3 << 30
    assert vset.kv_cache_bytes(model(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                     head_dim=128)) == 4 << 30
    assert vset.kv_cache_bytes(model(num_hidden_layers=2, num_attention_heads=16, kv_lora_rank=512)) == 4 << 30
    assert vset.kv_cache_bytes(model(num_hidden_layers=1, num_attention_heads=2, hidden_size=64)) == 256 << 20


def test_engines_are_reused_per_configuration(model_dir, monkeypatch, tmp_path):
    from fixtures.runtime import costs
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    costs.drain()
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=1)
    try:
        with impl.make_engine(model_dir) as e1:
            pid1 = e1.engine.proc.pid
            assert e1.history() == f"a fresh engine (worker pid {pid1}, nothing generated before)"
            e1.generate(_reqs()[:1])
            with impl.make_engine(model_dir, EngineSettings(enable_prefix_caching=True, cuda_graphs=False)) as e2:
                assert e2.engine.proc.pid == pid1, "the same configuration must reuse the live engine"
                # a state line says what a reused engine ran before (C5: an output must not depend on it)
                assert e2.history() == (f"a reused engine (worker pid {pid1}): lease 2 of this configuration in "
                                        "its worker, 1 generate() calls before this run"), e2.history()
                # a made engine starts cold: the shared prefix of request a is not cached any more
                assert e2.generate([Request("x", _reqs()[0].prompt_ids[:40] + (3,), SamplingParams())])[0] \
                    .num_cached_tokens == 0
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=3)) as e3:
            assert e3.engine.proc.pid != pid1
            assert e3.last_stats().steps == 0
        assert impl.pool.starts == 2 and impl.pool.reuses == 1
        starts = [c for c in costs.drain() if c["kind"] == "engine start"]     # the report's time section
        assert [c["what"] for c in starts] == ["default settings", "max_num_seqs=3"], starts
        assert all(c["s"] > 0 for c in starts)
        # each start's phases, timed in the worker around the steps of vLLM's GPU Worker (the fake's)
        # and what the rest is: the engine's set-up around them, the wait for the worker's imports
        from fixtures.vllm.start_phases import IMPORT_WAIT, OUTSIDE, PHASES
        for c in starts:
            assert list(c["parts"]) == list(PHASES.values()) + [OUTSIDE, IMPORT_WAIT], c
            assert all(c["parts"][p] > 0 for p in PHASES.values()), c
            assert c["parts"][IMPORT_WAIT] > 0, f"a worker spawned for the start imports on its clock: {c}"
            # the parts and the total are each rounded to the millisecond: the parts may overshoot by half a ms each
            assert sum(c["parts"].values()) <= c["s"] + 0.0005 * len(c["parts"]), c
        first = impl.pool.entries[next(iter(impl.pool.entries))][0]
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=5)):
            pass
        assert len(impl.pool.entries) == 1, "max_idle=1 keeps one idle engine"
        assert first.proc.poll() is not None
    finally:
        impl.pool.close_all()
    assert not impl.pool.entries


def test_closed_lease_refuses_use(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=0)
    lease = impl.make_engine(model_dir)
    proc = lease.engine.proc
    lease.close()
    lease.close()
    with pytest.raises(RuntimeError, match="closed"):
        lease.generate([])
    assert proc.poll() is not None, "max_idle=0 closes an engine as soon as it is released"


def test_prespawned_worker_is_used_only_for_its_environment(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    pool = vpool.EnginePool(max_idle=0, prespawn=True)
    try:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "some other test (setup)")
        pool.refill(vipc.worker_env(EngineSettings(), fake="echo"))
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "this test (call)")
        env = vipc.worker_env(EngineSettings(), fake="echo")
        off = vipc.worker_env(EngineSettings(batch_invariant=False), fake="echo")
        spare_pid = pool.spares[vipc.env_key(env)].proc.pid
        assert pool.take_spare(off) is None
        assert len(pool.spares) == 1, "a spare for another environment stays for a later start"
        with vclient.VLLMEngine(model_dir, fake="echo", spawned=pool.take_spare(env)) as eng:
            assert eng.proc.pid == spare_pid and not pool.spares and pool.spares_used == 1
            assert eng.generate(_reqs()[:1])[0].request_id == "a"
            assert "# settings:" in eng.log_path.read_text()
        # after an invariance-off start the pool keeps a spare for each environment, default first
        pool.refill(env, off)
        assert list(pool.spares) == [vipc.env_key(env), vipc.env_key(off)]
        took = pool.take_spare(off)
        with vclient.VLLMEngine(model_dir, EngineSettings(batch_invariant=False), fake="echo", spawned=took) as eng:
            assert eng.proc.pid == took.proc.pid and eng.info["env"]["VLLM_BATCH_INVARIANT"] == "0"
        # at most MAX_SPARES: a third environment's spare replaces the one not asked for now
        pool.refill(env, off)
        third = vipc.worker_env(EngineSettings(extra={"env": {"SOME_KNOB": "1"}}), fake="echo")
        displaced = pool.spares[vipc.env_key(off)]
        pool.refill(env, third)
        assert list(pool.spares) == [vipc.env_key(env), vipc.env_key(third)]
        displaced.proc.wait(timeout=30)
        stale = pool.take_spare(env)
        with vclient.VLLMEngine(model_dir, EngineSettings(batch_invariant=False), fake="echo", spawned=stale) as eng:
            assert eng.proc.pid != stale.proc.pid and eng.info["env"]["VLLM_BATCH_INVARIANT"] == "0"
        assert stale.proc.poll() is not None, "a spare handed to the wrong environment is discarded"
    finally:
        pool.close_all()


def test_a_closed_engines_worker_serves_the_next_engine_of_its_environment(model_dir, tmp_path, monkeypatch):
    """Recycling: a closed engine's worker process (vLLM imported) is its environment's spare, so the
    next start there waits for no import; never one of another environment, and never a compiled
    engine's (torch.compile's caches are process-wide)."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=0)
    impl.pool.recycle = True            # off for fake workers by default
    try:
        first = impl.make_engine(model_dir)
        pid, env = first.engine.proc.pid, first.engine.env
        first.close()                   # max_idle=0: closed at once, its process kept
        assert impl.pool.recycled == 1 and impl.pool.spares[vipc.env_key(env)].engines == 1
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=3)) as second:
            assert second.engine.proc.pid == pid, "the next start of the environment runs in the kept process"
            assert "engine 2 of a recycled worker process" in second.history()
            assert second.generate(_reqs()[:1])[0].request_id == "a"
            assert impl.pool.recycled_used == 1
        with impl.make_engine(model_dir, EngineSettings(batch_invariant=False)) as off:
            assert off.engine.proc.pid != pid and off.engine.engines_before == 0, "another environment's process"
        assert impl.pool.recycled == 3
        with impl.make_engine(model_dir, EngineSettings(compilation=True)) as compiled:
            engine = compiled.engine
            assert engine.proc.pid == pid and engine.recyclable == "a compiled engine"
            proc = engine.proc
        proc.wait(timeout=30)
        assert all(sp.proc.pid != pid for sp in impl.pool.spares.values()), "a compiled engine's process is ended"
        assert "worker recycled for the next engine" in Path(engine.log_path).read_text()
    finally:
        impl.pool.close_all()


@pytest.mark.parametrize("recycle", [True, False], ids=["recycle", "control"])
def test_a_start_whose_spare_is_still_importing_takes_an_idle_engines_process(model_dir, tmp_path, monkeypatch,
                                                                             recycle):
    """No ready process for the environment (its spare still importing: planted by making fresh
    spares never ready): the least recently used idle engine of that environment is closed and the
    start runs in its process; the importing spare stays for a later start. Control: without
    recycling the start waits for the spare and the idle engine stays."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    monkeypatch.setattr(vipc.SpawnedWorker, "ready", lambda self: self.engines > 0)
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=2)
    impl.pool.recycle, impl.pool.prespawn = recycle, True
    try:
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=3)) as first:
            idle_pid = first.engine.proc.pid
        env = vipc.worker_env(EngineSettings(), fake="echo")
        impl.pool.refill(env)
        spare_pid = impl.pool.spares[vipc.env_key(env)].proc.pid
        assert impl.pool.spares[vipc.env_key(env)].ready() is False
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=5)) as second:
            pid = second.engine.proc.pid
        if recycle:
            assert pid == idle_pid and len(impl.pool.entries) == 1, "the idle engine's process served the start"
            assert spare_pid in {sp.proc.pid for sp in impl.pool.spares.values()}, "the importing spare stays"
        else:
            assert pid == spare_pid and len(impl.pool.entries) == 2, "without recycling it waits for the spare"
    finally:
        impl.pool.close_all()


def test_a_worker_whose_teardown_keeps_device_memory_is_ended_not_recycled(model_dir, tmp_path, monkeypatch):
    """The control: the planted teardown leaves 8 GiB held (over RECYCLE_MAX_BYTES), so the process
    is ended and the next start gets a fresh one."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    impl = vimpl.VLLMImplementation(fake="keep_memory_on_recycle", max_idle=0)
    impl.pool.recycle = True
    try:
        first = impl.make_engine(model_dir)
        proc, log = first.engine.proc, first.engine.log_path
        first.close()
        proc.wait(timeout=30)
        assert impl.pool.recycled == 0 and not impl.pool.spares
        assert "worker not recycled: it still held 8.00 GiB" in Path(log).read_text()
        with impl.make_engine(model_dir) as second:
            assert second.engine.proc.pid != proc.pid and second.engine.engines_before == 0
    finally:
        impl.pool.close_all()


def test_the_workers_environment_is_the_configured_one_not_what_checks_set_later(model_dir, tmp_path, monkeypatch):
    """A variable this process gains after the implementation is configured (torch's profiler sets
    TEARDOWN_CUPTI=0 here when a check profiles) does not reach the workers: the configured
    spare still serves the next start. Control: the worker environment of the process as it is
    now is another one, and a pool asked for it says which variable differs (its costs)."""
    from fixtures.runtime import costs
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=0)
    impl.pool.prespawn = True
    try:
        impl.prepare_process()
        spare = impl.pool.spares[vipc.env_key(impl._env(EngineSettings()))]
        monkeypatch.setenv("TEARDOWN_CUPTI", "0")
        with impl.make_engine(model_dir) as lease:
            assert lease.engine.proc.pid == spare.proc.pid and "TEARDOWN_CUPTI" not in lease.engine.env
        now = vipc.worker_env(EngineSettings(), fake="echo")
        assert not vipc.same_env(now, spare.env), "control: the process's environment did change"
        costs.drain()
        assert impl.pool.take_spare(now) is None, "no spare of the changed environment"
        noted = [e["what"] for e in costs.drain() if e["kind"] == "worker environment new to this process"]
        assert noted and "TEARDOWN_CUPTI (unset -> 0)" in noted[0], noted
    finally:
        impl.pool.close_all()


def _zygote_impl(max_idle: int = 0):
    """A fake-worker implementation whose pool forks its workers from zygotes (off for fake workers
    by default, like recycling)."""
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=max_idle)
    impl.pool.zygotes = vipc.Zygotes()
    return impl


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads parent pids from /proc")
def test_workers_are_forked_from_their_environments_zygote(model_dir, tmp_path, monkeypatch):
    """Each environment's zygote imports once and forks its workers: an engine's process is the
    zygote's child (not this process's), serves the protocol, says so in its state line and log,
    and its start waited for no import; another environment gets a zygote of its own; a forked
    worker that dies is seen dead (the client refuses it), and closing ends it."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    impl = _zygote_impl()
    try:
        with impl.make_engine(model_dir) as first:
            z = impl.pool.zygotes.of(vipc.worker_env(EngineSettings(), fake="echo"))
            proc = first.engine.proc
            assert isinstance(proc, vipc.ForkedProcess) and _ppid(proc.pid) == z.proc.pid != os.getpid()
            assert first.generate(_reqs()[:1])[0].request_id == "a"
            assert "forked from its environment's zygote" in first.history()
            assert "forked from the zygote pid" in Path(first.engine.log_path).read_text()
            assert z.state == "ready" and "zygote ready: forkable" in Path(z.log_path).read_text()
        assert proc.wait(timeout=30) == -1, "closing the engine ends the forked worker"
        with impl.make_engine(model_dir, EngineSettings(batch_invariant=False)) as off:
            z_off = impl.pool.zygotes.of(vipc.worker_env(EngineSettings(batch_invariant=False), fake="echo"))
            assert z_off is not z and _ppid(off.engine.proc.pid) == z_off.proc.pid
            assert off.engine.info["env"]["VLLM_BATCH_INVARIANT"] == "0", "the zygote's environment is the worker's"
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=3)) as third:
            third.engine.proc.kill()
            third.engine.proc.wait(timeout=30)
            with pytest.raises(vipc.VLLMWorkerError, match="not running"):
                third.generate(_reqs()[:1])
        assert impl.pool.forked_used == 3 and z.forks == 2
    finally:
        impl.pool.close_all()
    assert z.proc.poll() is not None, "the pool's end ends its zygotes"


def test_a_spare_is_forked_at_once_and_a_start_waits_for_an_importing_zygote(model_dir, tmp_path, monkeypatch):
    """refill forks a spare only once the zygote has imported (never a second import meanwhile); a
    start with no spare waits for the zygote's imports and counts that wait as an import wait."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    impl = _zygote_impl(max_idle=2)
    impl.pool.prespawn = True
    env = vipc.worker_env(EngineSettings(), fake="echo")
    try:
        impl.pool.refill(env)
        assert impl.pool.spares == {} and impl.pool.zygotes.of(env).state == "importing", \
            "no spare while its zygote imports (nor a spawned one)"
        with impl.make_engine(model_dir) as first:
            assert first.engine.forked and _ppid(first.engine.proc.pid) == impl.pool.zygotes.of(env).proc.pid
            assert "waiting for the worker's vLLM import" in first.engine.info["start_phases"]
        spare = impl.pool.spares[vipc.env_key(env)]
        assert spare.forked and spare.ready(), "after a start the next one's spare is forked at once"
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=3)) as second:
            assert second.engine.proc.pid == spare.proc.pid
    finally:
        impl.pool.close_all()


def test_a_zygote_that_cannot_fork_falls_back_to_spawned_workers(model_dir, tmp_path, monkeypatch):
    """The control: a zygote that refuses to fork (planted, as one whose imports started a thread
    or CUDA would) says why in its log, and the workers are spawned as without zygotes (this
    process's children), every engine working."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("CONFORMANCE_ZYGOTE_PLANT", "unforkable")
    impl = _zygote_impl()
    impl.pool.prespawn = True
    env = vipc.worker_env(EngineSettings(), fake="echo")
    try:
        with impl.make_engine(model_dir) as first:
            assert not first.engine.forked and _ppid(first.engine.proc.pid) == os.getpid()
            assert first.generate(_reqs()[:1])[0].request_id == "a"
        why = impl.pool.zygotes.failed(env)
        assert why and "cannot fork: planted" in why
        assert "NOT forkable: planted" in Path(impl.pool.zygotes.of(env).log_path).read_text()
        impl.pool.refill(env)
        assert not impl.pool.spares[vipc.env_key(env)].forked, "spares are spawned again"
        assert impl.pool.forked_used == 0
    finally:
        impl.pool.close_all()


# ---------------------------------------------------------------------------------------------
# the real engine (GPU + vLLM): the probes see each mechanism engage
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_impl():
    """The real implementation (one per module: one pre-spawned worker, engines closed on release)."""
    impl = vimpl.VLLMImplementation(max_idle=0)
    why = impl.unavailable()
    if why:
        pytest.skip(why)
    yield impl
    impl.pool.close_all()


def _small_config(kind: str) -> dict:
    """Small models with the real head_dim (128, as FA3 wants): dense qwen3 runs on vLLM's V2 model
    runner, qwen3_moe on the V1 runner (config/vllm.py:604-622), so both probe paths are covered."""
    from fixtures.models.proxies import RECIPES
    common = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=4096, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    if kind == "dense":
        return dict(RECIPES["qwen3"], intermediate_size=1024, max_window_layers=2, **common)
    return dict(RECIPES["qwen3_moe"], intermediate_size=1024, moe_intermediate_size=256, num_experts=8,
                num_experts_per_tok=2, mlp_only_layers=[], decoder_sparse_step=1, **common)


@pytest.fixture(scope="module", params=["dense", "moe"])
def small_model(request, tmp_path_factory):
    from fixtures.models.proxies import build_proxy
    if not torch.cuda.is_available():       # nothing to build for a test that will skip
        return None
    src = tmp_path_factory.mktemp(f"small-{request.param}-src")
    (src / "config.json").write_text(json.dumps(_small_config(request.param)))
    return build_proxy(src, "full", tmp_path_factory.mktemp(f"small-{request.param}"), dtype=torch.bfloat16).path


@pytest.mark.gpu
@pytest.mark.vllm
def test_real_engine_round_trip(real_impl, small_model):
    impl = real_impl
    with impl.make_engine(small_model) as eng:
        reqs = [Request(f"r{i}", tuple(range(3 + i, 40 + 5 * i)), SamplingParams(max_tokens=6, temperature=float(i % 2),
                                                                                 seed=i, n=1 + i % 2))
                for i in range(5)]
        out = eng.generate(reqs)
        stats = eng.last_stats()
        assert [c.request_id for c in out] == [r.request_id for r in reqs]
        assert all(len(s.token_ids) == 6 and s.logprobs.dtype == torch.float32 for c in out for s in c.samples)
        assert stats.steps > 0 and stats.max_running > 1 and stats.extra["forward_steps"] > 0
        (pl,) = eng.prompt_logprobs([list(reqs[0].prompt_ids) + out[0].samples[0].token_ids])
        assert pl.shape[0] == len(reqs[0].prompt_ids) + 5
        info = eng.engine.info
    assert info["attention_backends"] == ["FLASH_ATTN"] and info["batch_invariant"] and info["async_scheduling"]
    assert info["cudagraph_mode"] == "NONE" and info["compilation_mode"] == "NONE"


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("settings, evidence", [
    (EngineSettings(max_num_batched_tokens=16), "chunked_prompts"),
    (EngineSettings(kv_cache_blocks=8, max_num_seqs=8), "preemptions"),
    (EngineSettings(cuda_graphs=True), "graph_steps"),
])
def test_real_engine_mechanisms_engage(real_impl, small_model, settings, evidence):
    impl = real_impl
    reqs = [Request(f"r{i}", tuple(range(5 + i, 50 + 3 * i)), SamplingParams(max_tokens=24)) for i in range(6)]
    with impl.make_engine(small_model, settings) as eng:
        eng.generate(reqs)
        stats = eng.last_stats()
    assert getattr(stats, evidence) > 0, f"{evidence} never engaged under {settings}: {stats}"


@pytest.mark.gpu
@pytest.mark.vllm
def test_real_prefix_cache_hit_is_read(real_impl, small_model):
    impl = real_impl
    shared = tuple(range(7, 71))
    with impl.make_engine(small_model) as eng:
        eng.generate([Request("warm", shared + (1, 2), SamplingParams(max_tokens=2))])
        hit = eng.generate([Request("probe", shared + (3,), SamplingParams(max_tokens=2))])[0]
        again = eng.generate([Request("pl", shared + (3,), SamplingParams(max_tokens=2), want_prompt_logprobs=True)])[0]
    assert hit.num_cached_tokens >= 48
    assert again.num_cached_tokens == 0 and again.prompt_logprobs.shape[0] == len(shared)



def test_canonical_weights_split_merged_projections():
    """vLLM's merged qkv_proj / gate_up_proj come back under the checkpoint's q/k/v and
    gate/up names, split by the layers' output sizes; other names pass through; fused MoE
    experts are n/a; a size mismatch is a clear error."""
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    g, u = torch.randn(6, 4), torch.randn(6, 4)
    params = [("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v])),
              ("model.layers.0.mlp.gate_up_proj.weight", torch.cat([g, u])),
              ("model.norm.weight", torch.ones(4))]
    sizes = {"model.layers.0.self_attn.qkv_proj": [8, 2, 2], "model.layers.0.mlp.gate_up_proj": [6, 6]}
    out = dict(vconv.canonical_weights(params, sizes))
    assert list(out) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                         "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                         "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], k)
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], u)
    with pytest.raises(ValueError, match="cannot split"):
        list(vconv.canonical_weights(params, {"model.layers.0.self_attn.qkv_proj": [8, 4]}))
    w13, w2 = torch.arange(2 * 6 * 4.0).reshape(2, 6, 4), torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)
    moe = dict(vconv.canonical_weights([("model.layers.0.mlp.experts.routed_experts.w13_weight", w13),
                                     ("model.layers.0.mlp.experts.w2_weight", w2)], {}))
    assert sorted(moe) == sorted(f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 1)
                                 for p in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(moe["model.layers.0.mlp.experts.1.up_proj.weight"], w13[1, 3:])
    assert torch.equal(moe["model.layers.0.mlp.experts.0.down_proj.weight"], w2[0])
    with pytest.raises(NotImplementedError, match="^n/a: canonical checkpoint names of vLLM's fused MoE"):
        list(vconv.canonical_weights([("model.layers.0.mlp.experts.w13_weight_scale", torch.zeros(2, 4))], {}))


def test_weight_push_through_the_worker_protocol(model_dir, tmp_path):
    """load_weights travels as a safetensors file to the worker, weight_hashes come back under the
    names pushed (fake backend: the real one reloads through vLLM's runner)."""
    from fixtures.reference.hf_trainer import tensor_sha256
    weights = {"model.embed_tokens.weight": torch.randn(10, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path) as eng:
        assert eng.capabilities().weight_update
        eng.load_weights(weights)
        assert eng.weight_hashes() == {k: tensor_sha256(v) for k, v in weights.items()}
    assert not list(tmp_path.glob("*.weights.safetensors")), "the weights file must not be left behind"



def test_tensor_parallel_is_a_setting_vllm_must_honour():
    """TP=2 reaches vLLM's kwargs, is part of the engine identity, and a worker that resolved
    another degree is refused; the kernel inventory is n/a there (runners in vLLM's workers)."""
    from dataclasses import replace
    tp2 = replace(vset.EAGER_DEFAULTS, tensor_parallel_size=2)
    assert vset.llm_kwargs("/m", EngineSettings(), tp2)["tensor_parallel_size"] == 2
    assert vset.llm_kwargs("/m", EngineSettings())["tensor_parallel_size"] == 1
    assert vset.engine_key("/m", EngineSettings(), tp2) != vset.engine_key("/m", EngineSettings())
    eff = vset.effective_settings(EngineSettings(), tp2)
    assert any("tensor_parallel_size" in m for m in vset.resolution_mismatches(eff, _info(tensor_parallel_size=1)))
    assert vimpl.tensor_parallel_2().defaults.tensor_parallel_size == 2
    tp2_trainer = vimpl.tensor_parallel_2_engine_kernels()
    assert tp2_trainer.defaults.tensor_parallel_size == 2 and tp2_trainer.trainer_kind == "engine-kernels"
    assert "TP=2" in tp2_trainer.describe()["trainer"] and "tensor_parallel_size=2" in tp2.describe()


def test_module_outputs_through_the_worker_protocol(model_dir, tmp_path):
    """module_outputs records in the worker and comes back as (name, [tokens, -1]) in call order
    (fake backend: two canned points); the file is not left behind; n/a at TP>1, refused when
    graphs or compilation would bypass the hooks."""
    from dataclasses import replace
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path) as eng:
        got = eng.module_outputs([3, 1, 4, 1, 5])
    assert [k for k, _ in got] == ["model.embed_tokens", "model.norm"]
    assert got[1][1].flatten().tolist() == [6.0, 2.0, 8.0, 2.0, 10.0]
    assert not list(tmp_path.glob("*.modules.safetensors"))
    with vclient.VLLMEngine(model_dir, EngineSettings(cuda_graphs=True), fake="echo", log_dir=tmp_path) as eng:
        with pytest.raises(ValueError, match="needs an eager engine"):
            eng.module_outputs([1, 2])
    tp2 = replace(vset.EAGER_DEFAULTS, tensor_parallel_size=2)
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path, defaults=tp2) as eng:
        with pytest.raises(NotImplementedError, match="^n/a: module outputs"):
            eng.module_outputs([1, 2])


def test_transformers_backend_is_a_setting_vllm_must_honour():
    """model_impl reaches vLLM's kwargs only when asked; a worker that loaded a native class
    instead is refused; that engine's module points are transformers-named."""
    tb = vimpl.transformers_backend()
    assert tb.defaults.model_impl == "transformers" and tb.trainer_kind == "engine-kernels"
    assert vset.llm_kwargs("/m", EngineSettings(), tb.defaults)["model_impl"] == "transformers"
    assert "model_impl" not in vset.llm_kwargs("/m", EngineSettings())
    eff = vset.effective_settings(EngineSettings(), tb.defaults)
    assert any("model_impl" in m for m in vset.resolution_mismatches(eff, _info(model_class="Qwen3ForCausalLM")))
    assert not any("model_impl" in m for m in
                   vset.resolution_mismatches(eff, _info(model_class="TransformersForCausalLM")))


def test_record_rows_through_the_worker_protocol(model_dir, tmp_path):
    """C3's localisation for vLLM: the worker keeps one request's prompt rows in each recorded
    generate(); alone vs in a batch, the first differing point is named (fake backend: its
    'model.norm' row carries the batch size). n/a at TP>1; the engine reports its TP degree."""
    from dataclasses import replace
    from fixtures.diagnose.engine_rows import localise_in_engine
    needle = Request("needle", (3, 1, 4), SamplingParams(max_tokens=2))
    batch = [Request("a", (9, 9), SamplingParams(max_tokens=2)), needle]
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path) as eng:
        with eng.record_rows("needle") as rows:
            eng.generate([needle])
        assert sorted(rows.rows) == sorted((p, m) for p in range(3) for m in ("model.embed_tokens", "model.norm"))
        text = localise_in_engine(eng, needle, batch, 1)
        assert text.startswith("token 0, model.norm (RMSNorm): 1 of 1 output elements differ") and "ULP" in text
        assert eng.tensor_parallel_size == 1
        assert "equal" in localise_in_engine(eng, needle, [needle], 0)
    assert not list(tmp_path.glob("*.rows.safetensors"))
    tp2 = replace(vset.EAGER_DEFAULTS, tensor_parallel_size=2)
    with vclient.VLLMEngine(model_dir, fake="echo", log_dir=tmp_path, defaults=tp2) as eng:
        assert eng.tensor_parallel_size == 2
        with pytest.raises(NotImplementedError, match="^n/a: rows are recorded"):
            with eng.record_rows("needle"):
                pass


def test_start_phases_time_each_step_and_restore_the_methods():
    """The timer wraps exactly the GPU Worker's start steps for the block and puts them back."""
    import time
    from fixtures.vllm.start_phases import PHASES, timed_phases

    class Steps:
        def load_model(self, *, load_dummy_weights=False):
            time.sleep(0.02)
            return "loaded"

        def determine_available_memory(self):
            return 7

        def execute_model(self):        # not a start step: never timed
            return "ran"
    original = Steps.__dict__["load_model"]
    with timed_phases(Steps) as spent:
        w = Steps()
        assert w.load_model(load_dummy_weights=True) == "loaded" and w.determine_available_memory() == 7
        assert w.execute_model() == "ran"
    assert set(spent) == {PHASES["load_model"], PHASES["determine_available_memory"]}, spent
    assert spent[PHASES["load_model"]] >= 0.02
    assert Steps.__dict__["load_model"] is original


def test_the_next_start_imports_during_this_one(model_dir, tmp_path, monkeypatch):
    """The spare worker for the next engine start is spawned when a start begins, not after it
    ends: on the H200 a worker's vLLM import took ~25 s, so a spare spawned after a check's first
    start was not ready for its second. The second start then runs on it."""
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path))
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=2)
    impl.pool.prespawn = True           # off for fake workers by default
    refilled_with = []
    real_refill = impl.pool.refill

    def spy(*envs):
        refilled_with.append(len(impl.pool.entries))
        real_refill(*envs)
    monkeypatch.setattr(impl.pool, "refill", spy)
    try:
        with impl.make_engine(model_dir):
            pass
        assert refilled_with == [0], "the spare is spawned before the first engine exists"
        spare = impl.pool.spares[vipc.env_key(vipc.worker_env(EngineSettings(), fake="echo"))]
        with impl.make_engine(model_dir, EngineSettings(max_num_seqs=3)) as second:
            assert second.engine.proc.pid == spare.proc.pid and impl.pool.spares_used == 1
    finally:
        impl.pool.close_all()


def test_a_weight_push_streams_host_tensors_to_vllm(tmp_path, monkeypatch):
    """The engine worker hands vLLM's reload_weights a lazy iterator of host tensors read from the
    pushed file one at a time (as vLLM's cold load does), not the whole file loaded onto the GPU
    first - that doubled the weights' footprint during a push (a C9 push ran out of memory on an
    H100, 2026-12-05). Stub runner: what it is given, and when each tensor is read."""
    import types
    from safetensors.torch import save_file
    from fixtures.vllm import worker as vworker
    weights = {"model.embed_tokens.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(8, 4)}
    save_file(weights, str(tmp_path / "push.safetensors"))
    seen = {}

    class Runner:
        def reload_weights(self, weights_iterator, is_checkpoint_format):
            seen["lazy"] = isinstance(weights_iterator, types.GeneratorType)
            seen["tensors"] = {name: t for name, t in weights_iterator}
            seen["checkpoint_format"] = is_checkpoint_format

    backend = object.__new__(vworker.VLLMBackend)
    backend.runner, backend.llm = Runner(), types.SimpleNamespace(reset_prefix_cache=lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert backend.load_weights(str(tmp_path / "push.safetensors")) is True
    assert seen["lazy"] and seen["checkpoint_format"]
    assert sorted(seen["tensors"]) == sorted(weights)
    for name, t in seen["tensors"].items():
        assert t.device.type == "cpu" and torch.equal(t, weights[name])
