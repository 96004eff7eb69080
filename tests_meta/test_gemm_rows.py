"""The cublaslt fix and C2's GEMM row check on the CPU (fixtures.vllm.fixes, fixtures.vllm.gemm_rows):
the fix is named only (not in `all`), its cuBLAS settings reach a batch-invariant worker's and the
trainer's environment before CUDA and never a stock control's, and the row check on the fake
kernel worker passes the invariant GEMM across two processes, catches a planted GEMM that rounds
calls of at most 256 rows differently, and sees the fake's stock cuBLAS vary (the negative
control). The real GEMMs run only on a GPU: docs/vllm-fixes.md has the commands."""
from __future__ import annotations

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import EngineSettings
from fixtures.vllm import fixes as FX
from fixtures.vllm import gemm_rows as GR
from fixtures.vllm import kernel_cases as VKC
from fixtures.vllm.ipc import worker_env

DIMS = dict(hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=100, experts=0, top_k=0,
            moe_intermediate=0)
SIZES = [1, 7, 64, 255, 256, 257, 600]


def test_cublaslt_is_named_only_never_part_of_all():
    assert "cublaslt" in FX.FIXES and "cublaslt" not in FX.parse("all")
    assert FX.parse("cublaslt,fused_add_rms_norm") == ("fused_add_rms_norm", "cublaslt")
    assert FX.process_env(("cublaslt",)) == FX.CUBLASLT_ENV == {"CUBLAS_WORKSPACE_CONFIG": ":16:8",
                                                                 "CUBLASLT_WORKSPACE_SIZE": "1"}
    assert FX.process_env(("cublaslt",), batch_invariant=False) == {} and FX.process_env(FX.parse("all")) == {}


def test_settings_reach_invariant_workers_only():
    base = {FX.FIXES_ENV: "cublaslt", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
    on = worker_env(EngineSettings(batch_invariant=True), base)
    off = worker_env(EngineSettings(batch_invariant=False), base)
    assert {k: on.get(k) for k in FX.CUBLASLT_ENV} == FX.CUBLASLT_ENV
    assert not {k for k in FX.CUBLASLT_ENV if k in off}, "a stock control inherits no fix's cuBLAS settings"
    plain = worker_env(EngineSettings(batch_invariant=True), {**base, FX.FIXES_ENV: "all"})
    assert not {k for k in FX.CUBLASLT_ENV if k in plain}


def test_an_engines_own_fixes_bring_the_settings():
    """An engine whose EngineSettings.extra env names the fix (the side-by-side script's third
    engine) gets the settings though the parent's --vllm-fixes does not name it."""
    env = worker_env(EngineSettings(batch_invariant=True, extra={"env": {FX.FIXES_ENV: "cublaslt"}}),
                     {FX.FIXES_ENV: "none"})
    assert {k: env.get(k) for k in FX.CUBLASLT_ENV} == FX.CUBLASLT_ENV
    mine = worker_env(EngineSettings(batch_invariant=True, extra={"env": {FX.FIXES_ENV: "cublaslt",
                                                                          "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}), {})
    assert mine["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8", "what an engine sets itself wins"


def test_trainer_process_gets_the_settings(monkeypatch):
    """The engine-kernel trainer runs vLLM's linear layers in the pytest process: the settings go
    into that process's environment at configure time (ConfiguresProcess), only with the fix named."""
    from fixtures.vllm.implementation import VLLMImplementation
    impl = VLLMImplementation(fake="echo", max_idle=0, trainer="engine-kernels")
    monkeypatch.setenv(FX.FIXES_ENV, "cublaslt")
    assert impl.process_environment() == {"VLLM_BATCH_INVARIANT": "1", **FX.CUBLASLT_ENV}
    monkeypatch.setenv(FX.FIXES_ENV, "all")
    assert impl.process_environment() == {"VLLM_BATCH_INVARIANT": "1"}


def test_refused_at_tensor_parallel(monkeypatch):
    monkeypatch.setenv(FX.FIXES_ENV, "cublaslt")
    with pytest.raises(RuntimeError, match="cublaslt: not available at tensor_parallel_size=2"):
        FX.install_in_engine({"tensor_parallel_size": 2})


def test_shapes_are_the_models_projections_and_lm_head():
    assert GR.gemm_shapes(DIMS) == [("qkv_proj", 64, 32), ("o_proj", 32, 32), ("gate_up_proj", 96, 32),
                                    ("down_proj", 32, 48), ("lm_head", 100, 32)]
    moe = GR.gemm_shapes({**DIMS, "experts": 8})
    assert [n for n, _, _ in moe] == ["qkv_proj", "o_proj", "lm_head"], "an MoE model's MLP is fused_moe"
    assert GR.MAX_GEMM_ROWS == max(GR.GEMM_SIZES) == 16384 and {1, 255, 256, 257, 8192} <= set(GR.GEMM_SIZES)


def test_fingerprint_is_order_free_and_sees_one_bit():
    t = torch.randn(300, 17).to(torch.bfloat16)
    fp = GR.fingerprint(t)
    assert fp == GR.fingerprint(t.clone())
    u = t.clone()
    u.view(torch.int16)[299, 16] ^= 1
    assert GR.fingerprint(u) != fp and GR.rows_differing(t, u) == [299]


@pytest.fixture(scope="module")
def fake_workers(tmp_path_factory):
    log = tmp_path_factory.mktemp("gemm-logs")
    live = {"chosen": [VKC.KernelWorker(batch_invariant=True, dims=DIMS, log_dir=log, fake="echo", fixes=("cublaslt",))
                       for _ in range(2)],
            "stock": [VKC.KernelWorker(batch_invariant=False, dims=DIMS, log_dir=log, fake="echo", fixes=())]}
    yield live
    for ws in live.values():
        for w in ws:
            w.close()


def test_fake_workers_start_with_their_environment(fake_workers):
    chosen, stock = fake_workers["chosen"][0].info, fake_workers["stock"][0].info
    assert chosen["fixes"] == {"cublaslt": "installed: fake"} and chosen["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert chosen["CUBLASLT_WORKSPACE_SIZE"] == "1"
    assert stock["CUBLAS_WORKSPACE_CONFIG"] is None and stock["CUBLASLT_WORKSPACE_SIZE"] is None


def test_invariant_gemm_passes_across_processes(fake_workers):
    out = GR.check_gemm_rows(fake_workers["chosen"], GR.gemm_shapes(DIMS), SIZES)
    assert set(out) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert all(not n for r in out.values() for n in r["differing"].values())
    assert all(r["alone_differing"] == 0 and r["largest"] == 600 for r in out.values())


def test_planted_gemm_is_caught(fake_workers):
    """The negative control of the check itself: rounding calls of <= 256 rows towards zero."""
    with pytest.raises(BitwiseMismatch, match="rows_differing") as info:
        GR.check_gemm_rows(fake_workers["chosen"][:1], GR.gemm_shapes(DIMS), SIZES, variant=GR.PLANTED)
    assert "planted_round_below_257" in str(info.value) and "row 0 alone" in str(info.value)


def test_stock_cublas_varies_below_257(fake_workers):
    """The fake's stock cuBLAS rounds calls of <= 256 rows differently: the stock control fires,
    naming the sizes whose rows differ from the largest call."""
    with pytest.raises(BitwiseMismatch) as info:
        GR.check_gemm_rows(fake_workers["stock"], GR.gemm_shapes(DIMS), SIZES)
    text = str(info.value)
    assert "VLLM_BATCH_INVARIANT=0, fixes: none" in text and "255 of 255" in text and "of 257" not in text


def test_a_worker_in_another_environment_is_caught_across_processes(fake_workers):
    """Two processes whose GEMMs differ only in small calls: the fingerprints differ."""
    with pytest.raises(BitwiseMismatch, match="across processes|row"):
        GR.check_gemm_rows([fake_workers["chosen"][0], fake_workers["stock"][0]], GR.gemm_shapes(DIMS)[:1], [7, 600])


def test_sizes_outside_the_range_are_refused(fake_workers):
    from fixtures.vllm.kernel_cases import KernelWorkerError
    with pytest.raises(KernelWorkerError, match="outside 1..16384"):
        GR.check_gemm_rows(fake_workers["chosen"][:1], GR.gemm_shapes(DIMS)[:1], [0, 5])
