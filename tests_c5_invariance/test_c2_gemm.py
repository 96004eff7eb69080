"""Gate C2 on the GEMM alone at rollout row counts: the `cublaslt` fix (docs/vllm-fixes.md) runs
vLLM's unquantized linear layers and LM head on plain torch matmul through cuBLASLt, with
CUBLAS_WORKSPACE_CONFIG=:16:8 and CUBLASLT_WORKSPACE_SIZE=1 in the kernel worker's environment
before CUDA starts. The rule: every row of an M-row call has the bits it has alone and inside the
largest (16,384-row) call, a second call repeats them, and another process of the same environment
gives the same bits - for hypothesis-drawn M from 1 to 16,384 (always 1, 7, 64, 255, 256, 257,
1024, 4096, 8192 and 16,384), at the (N, K) of the model's projections and LM head (the proxy's
config).

Negative controls: stock cuBLAS (a VLLM_BATCH_INVARIANT=0 worker, no workspace settings) must
vary - where it happens not to on this card the control is inconclusive, never a pass - and a
planted GEMM that rounds calls of at most 256 rows differently must be caught.

GPU only (`--impl vllm`, ChecksEngineKernels); n/a with the reason elsewhere. Not yet run on a GPU.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import ChecksEngineKernels
from fixtures.core.outcomes import must_fire, not_applicable
from fixtures.runtime.scheduling import ENGINE_KERNEL_SETUP

pytestmark = [pytest.mark.C2, pytest.mark.gpu, pytest.mark.vllm, pytest.mark.shared_setup(ENGINE_KERNEL_SETUP)]

_LIVE = settings(deadline=None, max_examples=8,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def library(engine_library):
    """The engine's kernel library, if it checks the GEMM at rollout row counts."""
    lib = engine_library
    if not hasattr(lib, "check_gemm_rows"):
        not_applicable("the engine kernel library has no GEMM row check (check_gemm_rows)",
                       capability=ChecksEngineKernels)
    return lib


@pytest.fixture(scope="module")
def shapes(library, proxy):
    """(name, N, K) of the model's projections and LM head, from the proxy's config."""
    return library.gemm_shapes(library.dims(json.loads((proxy.path / "config.json").read_text())))


@pytest.fixture(scope="module")
def gemm_workers(library, proxy):
    """Kernel workers started on demand: `chosen` (two processes, VLLM_BATCH_INVARIANT=1, the run's
    fixes plus cublaslt, its environment set before CUDA) and `stock` (VLLM_BATCH_INVARIANT=0)."""
    dims = library.dims(json.loads((proxy.path / "config.json").read_text()))
    live: dict[str, list] = {}

    def get(kind: str):
        if kind not in live:
            if kind == "stock":
                live[kind] = [library.worker(batch_invariant=False, dims=dims, fixes=())]
            else:
                fixes = tuple(n for n in library.fixes_selected() if n != library.gemm_fix) + (library.gemm_fix,)
                live[kind] = [library.worker(batch_invariant=True, dims=dims, fixes=fixes) for _ in range(2)]
                status = str((live[kind][0].info.get("fixes") or {}).get(library.gemm_fix, "not reported"))
                if status.startswith("not needed"):
                    not_applicable(f"fix {library.gemm_fix} {status}")
                assert status.startswith("installed"), f"fix {library.gemm_fix} was not installed: {status}"
        return live[kind]
    yield get
    for workers in live.values():
        for w in workers:
            w.close()


@_LIVE
@given(sizes=st.lists(st.integers(1, 16384), min_size=1, max_size=3, unique=True))
@example(sizes=[1, 7, 64, 255, 256, 257, 1024, 4096, 8192, 16384]).via("thresholds")
def test_gemm_rows(sizes, library, shapes, gemm_workers):
    """The chosen GEMM (cublaslt fix): each row of an M-row call == that row alone == that row of
    the largest call, run to run and in a second process."""
    sizes = sorted(set(sizes) | {library.gemm_max_rows})
    library.check_gemm_rows(gemm_workers("chosen"), shapes, sizes)


def test_control_stock_cublas_gemm_varies(library, shapes, gemm_workers, record_metric):
    """Stock cuBLAS (no workspace settings, VLLM_BATCH_INVARIANT=0) must give some row other bits
    at some M (measured on the H200: rows differ for M <= 256); where it does not, inconclusive."""
    sizes = list(library.gemm_sizes)
    with must_fire(f"stock cuBLAS gave every row the bits it has alone and in the {sizes[-1]}-row call at "
                   f"{sizes} rows on this card", tried=sizes) as control:
        library.check_gemm_rows(gemm_workers("stock"), shapes, sizes)
    record_metric("stock cuBLAS GEMM control", str(control.exc).splitlines()[0][:200])


def test_control_planted_gemm_is_caught(library, shapes, gemm_workers):
    """A planted GEMM that rounds calls of at most 256 rows towards zero (the chosen GEMM above)
    must fail the row check in the chosen worker: the check can see such a fault."""
    with pytest.raises(BitwiseMismatch, match="rows_differing"):
        library.check_gemm_rows(gemm_workers("chosen")[:1], shapes[:1], [1, 7, 255, 256, 257, 1024],
                                variant=library.gemm_planted)
