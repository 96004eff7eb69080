"""The fix pack for vLLM's variant kernels (fixtures.vllm.fixes, fixtures.vllm.fixed_kernels) on the
CPU: the --vllm-fixes option, the registry and its C0 / C2 wiring, the worker environment, the
compiled engine's arguments, and the fixed kernels' algorithm through their pure-torch twins (the
Triton kernels run only on a GPU: docs/vllm-fixes.md has the GPU commands)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.plugin.options import VLLM_FIX_NAMES, _fixes
from fixtures.vllm import fixed_kernels as FK
from fixtures.vllm import fixes as FX
from fixtures.vllm import kernel_cases as VKC
from fixtures.vllm.kernel_inventory import classify

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# the option and the registry
# ---------------------------------------------------------------------------------------------
def test_option_names_are_the_registry():
    """The plugin may not import fixtures.vllm, so it keeps the names: they must be the registry's."""
    assert VLLM_FIX_NAMES == tuple(FX.FIXES)


@pytest.mark.parametrize("text,want", [("none", "none"), ("all", "all"), (" compiled , fused_add_rms_norm ",
                                                                           "fused_add_rms_norm,compiled")])
def test_option_canonical_form(text, want):
    assert _fixes(text) == want
    assert FX.parse(want) == (tuple(n for n, f in FX.FIXES.items() if f.in_all) if want == "all"
                              else tuple(n for n in FX.FIXES if n in want))


def test_all_with_a_fix_it_leaves_out():
    """`all,cublaslt`: the pack and a fix not (yet) in it, in registry order."""
    assert _fixes("cublaslt, all") == "all,cublaslt"
    pack = tuple(n for n, f in FX.FIXES.items() if f.in_all)
    assert "cublaslt" not in pack and FX.parse("all,cublaslt") == tuple(n for n in FX.FIXES if n in pack + ("cublaslt",))


def test_mamba2_is_named_only_and_installs_the_engine_patch(monkeypatch):
    """`mamba2` (issue #47) installs the engine patch (fixtures/vllm/mamba2_patch.py), not yet run on
    a GPU: not in `all`; with VLLM_BATCH_INVARIANT=1 `install` calls the patch's install (its undo
    is what `activate` runs); a stock control reports it not installed; at tensor parallel > 1 it is
    refused, and the LLM(...) arguments it cannot serve are refused in one line before the engine
    is built. The patch itself on fake vLLM classes: tests_meta/test_vllm_mamba2_patch.py."""
    from fixtures.vllm import mamba2_patch
    assert "mamba2" not in FX.parse("all") and FX.parse("all,mamba2")[-1] == "mamba2"
    assert _fixes("mamba2,all") == "all,mamba2"
    fix = FX.FIXES["mamba2"]
    assert not fix.in_all and fix.patches and fix.in_trainer and fix.case is None and fix.check_kwargs
    assert "not yet run on a GPU" in fix.why and "mamba2_patch.py" in fix.replaces
    _fake_mamba2_backend(monkeypatch, type("Mamba2AttentionBackend", (), {
        "supports_batch_invariance": classmethod(lambda cls: False)}))          # as vLLM 0.26's
    assert fix.needed()[0] is True
    calls = []
    monkeypatch.setattr(mamba2_patch, "install", lambda: calls.append("install") or (lambda: calls.append("undo")))
    monkeypatch.setattr(FX, "_ACTIVE", {})
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert FX.install(("mamba2",), where="engine")["mamba2"].startswith("installed: replaces vLLM's Mamba-2 mixer path")
    assert calls == ["install"] and FX.installed() == ("mamba2",)
    FX.activate(())
    assert calls == ["install", "undo"] and FX.installed() == ()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert FX.install(("mamba2",))["mamba2"].startswith("not installed")
    monkeypatch.setenv(FX.FIXES_ENV, "mamba2")
    with pytest.raises(RuntimeError, match="mamba2: not available at tensor_parallel_size=2"):
        FX.install_in_engine({"tensor_parallel_size": 2})
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    for kwargs, what in (({"enable_prefix_caching": True}, "prefix caching"),
                         ({"speculative_config": {"method": "ngram"}}, "speculative decoding"),
                         ({"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}, "FULL graphs")):
        with pytest.raises(RuntimeError) as err:
            FX.install_in_engine(dict(kwargs))
        assert str(err.value).startswith("mamba2: ") and what in str(err.value) and "\n" not in str(err.value)
    assert calls == ["install", "undo"]          # refused before anything was installed
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert FX.install_in_engine({"enable_prefix_caching": True})[0]["mamba2"].startswith("not installed")


def _fake_mamba2_backend(monkeypatch, cls):
    import types
    names = ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.attention.backends.mamba2_attn")
    mods = {n: types.ModuleType(n) for n in names}
    for parent, child in zip(names, names[1:]):
        setattr(mods[parent], child.rsplit(".", 1)[1], mods[child])
    mods[names[-1]].Mamba2AttentionBackend = cls
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)


def test_mamba2_needed_reads_the_backend(monkeypatch):
    """needed(): True while vLLM's Mamba2AttentionBackend lacks batch invariance (no method, or it
    returns False: vLLM 0.26), False once it declares it; unknown without vLLM, which it then does
    not import (nor leave half-imported)."""
    monkeypatch.setitem(sys.modules, "vllm", None)          # vLLM absent: the import fails, nothing is loaded
    need, why = FX.FIXES["mamba2"].needed()
    assert need is None and why.startswith("unknown: vLLM not importable")
    assert "vllm.v1.attention.backends.mamba2_attn" not in sys.modules

    class Stock:                                            # vLLM 0.26: inherited from AttentionBackend
        @classmethod
        def supports_batch_invariance(cls):
            return False

    class Declared(Stock):
        @classmethod
        def supports_batch_invariance(cls):
            return True

    for cls, want in ((Stock, True), (type("Old", (), {}), True), (Declared, False)):
        _fake_mamba2_backend(monkeypatch, cls)
        need, why = FX.FIXES["mamba2"].needed()
        assert need is want and "Mamba2AttentionBackend" in why, (cls, why)


@pytest.mark.parametrize("text", ["bogus", "fused_add_rms_norm,bogus", "none,compiled", ""])
def test_unknown_fix_is_refused(text):
    with pytest.raises(ValueError, match="expected none, all"):
        _fixes(text) if text else _fixes(",")
    if text:
        with pytest.raises(ValueError):
            FX.parse(text)


def test_unknown_fix_is_one_usage_error(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv(FX.FIXES_ENV, raising=False)
    (pytester.path / "tests_c0_inventory").mkdir()
    (pytester.path / "tests_c0_inventory" / "test_probe.py").write_text(
        "import pytest\n@pytest.mark.C0\ndef test_probe():\n    pass\n")
    res = pytester.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                       "--vllm-fixes=fused_add_rms_norm,warp_drive")
    err = [line for line in res.stderr.str().splitlines() if line.strip()]
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str() + res.stderr.str()
    assert len(err) == 1 and err[0].startswith("ERROR: --vllm-fixes=") and "unknown fix warp_drive" in err[0], err
    assert FX.FIXES_ENV not in os.environ


def test_registry_wiring():
    """Every fix says what it replaces and where it is judged; its C2 case exists and is not a
    planted control; the kernels it installs map to its case in the C0 kernel table."""
    for fix in FX.FIXES.values():
        assert fix.replaces and fix.why and fix.judged_by
        if fix.case is not None:
            assert fix.case in VKC.CASES and not VKC.CASES[fix.case].planted
            assert set(fix.reached) <= set(VKC.CASES) and fix.reached
    for kernel, case in (("_conformance_fused_add_rms_norm_kernel", "fused_add_rms_norm"),
                         ("_conformance_row_sum_kernel", "sampler_softmax")):
        rule = classify(kernel, "conformance_fixes::fused_add_rms_norm")
        assert rule is not None and rule.case == case, (kernel, rule)
    assert FX.FIXES["fused_add_rms_norm"].in_trainer and not FX.FIXES["sampler_sum"].in_trainer


def test_install_respects_invariance_and_trainer(monkeypatch):
    """A stock control (VLLM_BATCH_INVARIANT=0) stays stock; the trainer takes only the fixes whose
    path it runs; nothing is installed by either."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert all(s.startswith("not installed") for s in FX.install(FX.FIXES).values())
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    got = FX.install(("sampler_sum", "compiled"), where="trainer")
    assert all(s.startswith("not in the trainer") for s in got.values())
    assert FX.installed() == ()


def test_compiled_fix_arguments():
    """A compiled engine keeps vLLM's custom ops and inductor's per-op rounding; an eager engine and
    an explicit custom_ops are left as they are; without the fix nothing changes."""
    compiled = {"enforce_eager": False, "compilation_config": {"mode": "VLLM_COMPILE", "cudagraph_mode": "NONE"}}
    kw, note = FX.adjust_llm_kwargs(compiled, ("compiled",))
    assert kw["compilation_config"]["custom_ops"] == ["all"] and "custom_ops=['all']" in note
    assert kw["compilation_config"]["inductor_compile_config"] == {"emulate_precision_casts": True}
    assert compiled["compilation_config"].get("custom_ops") is None            # the caller's dict untouched
    assert FX.adjust_llm_kwargs({"enforce_eager": True}, ("compiled",)) == ({"enforce_eager": True},
                                                                           "eager engine: nothing to change")
    given = {"enforce_eager": False, "compilation_config": {"mode": "VLLM_COMPILE", "custom_ops": ["+rms_norm"]}}
    assert FX.adjust_llm_kwargs(given, ("compiled",))[0]["compilation_config"]["custom_ops"] == ["+rms_norm"]
    assert FX.adjust_llm_kwargs(compiled, ("fused_add_rms_norm",)) == (compiled, None)


# ---------------------------------------------------------------------------------------------
# the worker environment: the fake backend and the fake kernel worker
# ---------------------------------------------------------------------------------------------
def test_fixes_reach_the_engine_worker(tmp_path, monkeypatch):
    from fixtures.vllm import client as vclient
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    monkeypatch.setenv(FX.FIXES_ENV, "sampler_sum,fused_add_rms_norm")
    with vclient.VLLMEngine(d, fake="echo", log_dir=tmp_path) as eng:
        assert list(eng.info["vllm_fixes"]) == ["fused_add_rms_norm", "sampler_sum"]


DIMS = {"hidden": 64, "intermediate": 32, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 96,
        "experts": 0, "top_k": 0, "moe_intermediate": 0}


@pytest.mark.parametrize("fix", ["fused_add_rms_norm", "sampler_sum"])
def test_kernel_worker_runs_a_case_without_and_with_a_fix(fix, tmp_path):
    """The C2 flow of test_vllm_fix_rows on the fake kernel worker (which plays vLLM 0.26's variants):
    red without the fix, green with it, in one worker; its start set is the default for a call."""
    case = FX.FIXES[fix].case
    sizes = [1, 7, 64, 256, 300]
    worker = VKC.KernelWorker(batch_invariant=True, dims=DIMS, log_dir=tmp_path, fake="echo", fixes=())
    try:
        with pytest.raises(BitwiseMismatch, match="fixes: none"):
            VKC.check_rows(worker, case, sizes)
        VKC.check_rows(worker, case, sizes, fixes=(fix,))
        with pytest.raises(BitwiseMismatch):
            VKC.check_rows(worker, case, sizes, fixes=())
    finally:
        worker.close()
    worker = VKC.KernelWorker(batch_invariant=True, dims=DIMS, log_dir=tmp_path, fake="echo", fixes=(fix,))
    try:
        assert worker.info["fixes"] == {fix: "installed: fake"}
        VKC.check_rows(worker, case, sizes)
    finally:
        worker.close()


# ---------------------------------------------------------------------------------------------
# the algorithm: the kernels' CPU twins give a row the same bits at every row count
# ---------------------------------------------------------------------------------------------
def _bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("H", [64, 2048, 4096, 5120])
def test_fused_add_rms_norm_twin_is_row_invariant(H):
    x, r, w = _bf16(300, H, seed=1), _bf16(300, H, seed=2), (1 + _bf16(H, seed=3, scale=0.1).float()).bfloat16()
    out, res = FK.reference_fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, (x.float() + r.float()).bfloat16())
    for M in (1, 7, 255, 256, 257, 300):
        o, z = FK.reference_fused_add_rms_norm(x[:M], r[:M], w, 1e-6)
        assert torch.equal(o, out[:M]) and torch.equal(z, res[:M]), M
    for i in (0, 11, 255, 299):
        o, _ = FK.reference_fused_add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-6)
        assert torch.equal(o[0], out[i]), i
    # the same norm as RMSNorm of the rounded sum, within bf16 rounding of a float64 reference
    z = res.double()
    want = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
    assert torch.allclose(out.double(), want, rtol=2 ** -7, atol=1e-6)


def test_fused_add_rms_norm_op_is_in_place_and_opaque_to_compile():
    """The drop-in for vllm._custom_ops.fused_add_rms_norm: in place on (input, residual) like the
    CUDA op, the twin's bits, and the same bits inside a compiled graph (aot_eager: the custom op
    is kept, not traced through)."""
    x, r, w = _bf16(9, 64, seed=4), _bf16(9, 64, seed=5), _bf16(64, seed=6)
    want_out, want_res = FK.reference_fused_add_rms_norm(x, r, w, 1e-6)
    xi, ri = x.clone(), r.clone()
    assert FK.fused_add_rms_norm(xi, ri, w, 1e-6) is None
    assert torch.equal(xi, want_out) and torch.equal(ri, want_res)

    def f(a, b):
        a, b = a.clone(), b.clone()
        FK.fused_add_rms_norm(a, b, w, 1e-6)
        return a, b
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if _get_current_dispatch_mode() is None:     # torch.compile refuses to run under a dispatch mode
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, r)          # (the planted CPU's)
        assert torch.equal(got[0], want_out) and torch.equal(got[1], want_res)
    xn, rn = x.clone(), r.clone()
    FK.fused_add_rms_norm(xn, rn, None, 1e-6)                     # RMSNorm(has_weight=False)
    assert torch.equal(xn, FK.reference_fused_add_rms_norm(x, r, None, 1e-6)[0])


@pytest.mark.parametrize("N", [1, 96, 2048, 151936 // 16])
def test_row_sum_and_softmax_twins_are_row_invariant(N):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(40, N, generator=g) * 3
    full, sm = FK.row_sum(x, -1), FK.softmax(x, -1)
    for M in (1, 7, 40):
        assert torch.equal(FK.row_sum(x[:M], -1), full[:M]) and torch.equal(FK.softmax(x[:M], -1), sm[:M]), M
    assert torch.equal(FK.row_sum(x[7:8], -1, keepdim=True)[:, 0], full[7:8])
    assert torch.allclose(full.double(), x.double().sum(-1), rtol=1e-5, atol=1e-3 * N ** 0.5)
    assert torch.allclose(sm.double().sum(-1), torch.ones(40, dtype=torch.float64), atol=1e-5)
    assert torch.equal(FK.row_sum(x.t(), 0), full)                 # another dim: moved last, same order


def test_tree_sum_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        FK.tree_sum(torch.ones(3, 6))


def test_compiled_fix_keeps_the_norm_kernel_opaque(monkeypatch):
    """Measured on the H200: in a compiled engine inductor re-generated vLLM's batch-invariant
    `_rms_norm_kernel` with eps typed fp64 (eager's launch types it fp32), 141 ULP at the first
    sampled token. The compiled fix routes RMSNorm-without-residual through an opaque custom op:
    inside a compiled graph the kernel's launcher still gets a Python float, and the residual path
    (the fused_add_rms_norm fix's op) is untouched. vLLM is faked here (CPU lane)."""
    import types
    seen = []

    def stock(input, weight, eps=1e-6, residual=None):      # stands for vLLM's launcher of the Triton kernel
        seen.append((type(eps), eps, residual is not None))
        if residual is not None:
            return input, residual
        out = input.float() * torch.rsqrt(input.float().pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float() if weight is not None else out).to(input.dtype)
    bi = types.ModuleType("vllm.model_executor.layers.batch_invariant")
    bi.rms_norm_batch_invariant = stock
    ln = types.ModuleType("vllm.model_executor.layers.layernorm")
    ln.rms_norm_batch_invariant = stock
    layers = types.ModuleType("vllm.model_executor.layers")
    layers.batch_invariant, layers.layernorm = bi, ln
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.model_executor", types.ModuleType("vllm.model_executor")),
                      ("vllm.model_executor.layers", layers), ("vllm.model_executor.layers.batch_invariant", bi),
                      ("vllm.model_executor.layers.layernorm", ln)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["vllm"].model_executor = sys.modules["vllm.model_executor"]
    sys.modules["vllm.model_executor"].layers = layers
    undo = FX._opaque_norm()
    try:
        x, w = _bf16(5, 64, seed=8), _bf16(64, seed=9)
        want = stock(x, w, 1e-6)
        seen.clear()
        assert torch.equal(ln.rms_norm_batch_invariant(x, w, 1e-6), want)
        assert seen == [(float, 1e-6, False)]
        r = _bf16(5, 64, seed=10)
        assert ln.rms_norm_batch_invariant(x, w, 1e-6, residual=r)[1] is r       # the residual path as it was
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        if _get_current_dispatch_mode() is None:     # torch.compile refuses to run under a dispatch mode
            seen.clear()
            graphs = []

            def backend(gm, inputs):
                graphs.append(str(gm.graph))
                return gm
            got = torch.compile(lambda a: ln.rms_norm_batch_invariant(a, w, 1e-6), backend=backend, fullgraph=True)(x)
            assert torch.equal(got, want) and seen == [(float, 1e-6, False)], seen
            assert "conformance_fixes.rms_norm" in graphs[0], graphs[0]
    finally:
        undo()
    assert ln.rms_norm_batch_invariant is stock


def test_compiled_bisect_script_names_the_variants_that_differ(monkeypatch, capsys):
    """benchmarks/compiled_bisect_gpu.py on the fake worker: eager and the four compiled variants,
    one table. A planted 1-ULP difference in every compiled engine but dynamo-only must show in
    those rows with its position, hex values and ULP distance (the script can report a difference),
    and dynamo-only stays equal."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compiled_bisect_gpu.py"
    spec = importlib.util.spec_from_file_location("compiled_bisect_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from fixtures.vllm import client
    real = client.VLLMEngine.prompt_logprobs

    def planted(self, seqs):
        out = real(self, seqs)
        cc = dict(self.kwargs.get("compilation_config") or {})
        if not self.kwargs.get("enforce_eager") and cc.get("backend") != "eager":
            out[1] = out[1].clone()
            out[1][3] = torch.nextafter(out[1][3], torch.tensor(float("inf")))
        return out
    monkeypatch.setattr(client.VLLMEngine, "prompt_logprobs", planted)
    assert mod.main(["--model", "qwen3", "--proxy", "tiny", "--fake", "echo"]) == 0
    rows = {r.split(" | ")[0][2:]: r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r}
    assert list(rows)[1:] == ["eager (reference)"] + [label for label, _, _ in mod.VARIANTS]
    assert "equal (" in rows["dynamo only (backend eager)"]
    for label in ("compiled (C5)", "inductor, emulate_precision_casts off", "inductor, division rounded as eager"):
        assert "**1 of" in rows[label] and "max 1 ULP" in rows[label] and "seq 1 (len 7) pos 3: 0x" in rows[label], rows[label]
    assert mod.main(["--fixes", "bogus", "--fake", "echo"]) == 2


def test_engine_history_script_sees_a_state_dependent_engine(monkeypatch, capsys):
    """benchmarks/engine_history_gpu.py on the fake worker: with every engine's output moved 1 ULP
    once it has served a first generate() (a planted history dependence), each configuration's
    'second' and 'after history' rows must report the difference with hex values and ULP distance,
    while a second fresh engine's first run stays equal; unplanted, every row is equal."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_history_gpu.py"
    spec = importlib.util.spec_from_file_location("engine_history_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--model", "qwen3", "--proxy", "tiny", "--fake", "echo"]

    def rows_of(out):
        return [r.split(" | ") for r in out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert mod.main(args) == 0
    clean = rows_of(capsys.readouterr().out)
    assert clean and all("equal" in r[3] for r in clean if len(r) > 3 and r[3]), clean
    from fixtures.vllm import client
    real = client.VLLMEngine.generate

    def planted(self, requests):
        out = real(self, requests)
        served = self.__dict__.setdefault("_served", 0)
        self._served = served + 1
        if served:
            s = out[0].samples[0]
            s.logprobs = s.logprobs.clone()
            s.logprobs[0] = torch.nextafter(s.logprobs[0], torch.tensor(float("inf")))
        return out
    monkeypatch.setattr(client.VLLMEngine, "generate", planted)
    assert mod.main(args) == 0
    rows = {(r[0][2:], r[1]): r for r in rows_of(capsys.readouterr().out)}
    for name, _ in mod.CONFIGS:
        for run in ("second", "after history"):
            assert "**1 differ**" in rows[(name, run)][3] and "1 ULP" in rows[(name, run)][3], rows[(name, run)]
        assert rows[(name, "first, not recorded (a second fresh engine)")][3] == "equal"
    assert mod.main(["--fixes", "bogus", "--fake", "echo"]) == 2
