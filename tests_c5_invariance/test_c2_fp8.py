"""Gate C2 on the engine's FP8 kernels (--vllm-quantization fp8: every engine serves the bf16 proxy
with vLLM's online dynamic FP8, as RL rollouts do). Two cases of the engine kernel library
(fixtures.vllm.fp8_rows): the dense FP8 linear (per-token dynamic `scaled_fp8_quant` + `cutlass_scaled_mm`
on Hopper) and the FP8 fused MoE (`fused_experts` with the online FP8 MoE method's quant config). The
rule: every row of an M-row call has the bits it has inside the largest call, and a second call
repeats them, for hypothesis-drawn M from 1 to 4096 (always 1, 16, 17, 64, 65, 128, 129, 256, 257,
1024 and 4096: both sides of CUTLASS's M buckets), at the model's widths. Where vLLM's FP8 path is
variant the check is red naming the kernel as the worker called it (expected for the fused MoE:
one dynamic activation scale per call, docs/design/mamba2-and-fp8.md D.2).

Negative control: the FP8 linear with a planted per-tensor dynamic activation scale (its value
depends on every row of the call) must be seen red.

Active only with --vllm-quantization fp8 on an implementation that is ChecksEngineKernels (`--impl
vllm`); n/a with the reason elsewhere. Not yet run on a GPU.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import ChecksEngineKernels
from fixtures.core.outcomes import not_applicable
from fixtures.runtime.scheduling import ENGINE_KERNEL_SETUP

pytestmark = [pytest.mark.C2, pytest.mark.gpu, pytest.mark.vllm, pytest.mark.shared_setup(ENGINE_KERNEL_SETUP)]

_LIVE = settings(deadline=None, max_examples=8,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FP8_CASES = ("fp8_linear", "fp8_fused_moe")


@pytest.fixture(scope="module")
def library(engine_library):
    """The engine's kernel library, if it checks FP8 kernels and the engines serve FP8 weights."""
    lib = engine_library
    if not hasattr(lib, "check_fp8_rows"):
        not_applicable("the engine kernel library has no FP8 row check (check_fp8_rows)", capability=ChecksEngineKernels)
    if getattr(lib, "quantization", None) != "fp8":
        not_applicable("the engines serve unquantized weights (the FP8 kernels run with --vllm-quantization fp8)")
    return lib


@pytest.fixture(scope="module")
def dims(library, proxy):
    return library.dims(json.loads((proxy.path / "config.json").read_text()))


@pytest.fixture(scope="module")
def fp8_worker(library, dims):
    """One VLLM_BATCH_INVARIANT=1 kernel worker with the run's fixes, at the model's widths."""
    worker = library.worker(batch_invariant=True, dims=dims)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def reached(library, engine_kernel_inventory):
    """The C2 cases the FP8 engine's kernels map to (C0 engine inventory, FP8 rules)."""
    return set(engine_kernel_inventory.kernel_cases())


@pytest.mark.parametrize("case", FP8_CASES)
@_LIVE
@given(sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=3, unique=True))
@example(sizes=[1, 16, 17, 64, 65, 128, 129, 256, 257, 1024, 4096]).via("CUTLASS M buckets")
def test_vllm_fp8_rows(case, sizes, library, dims, reached, fp8_worker):
    """An FP8 kernel: each row of an M-row call == that row of the 4096-row call, run to run."""
    if case not in library.cases_for(dims):
        not_applicable(f"{case} needs an MoE model (this model has no experts)")
    if case not in reached:
        not_applicable(f"the engine launched no kernel that maps to {case} for this model "
                       f"(C0 engine inventory reached: {', '.join(sorted(reached))})")
    library.check_fp8_rows(fp8_worker, case, sorted(set(sizes) | {max(library.fp8_sizes)}))


def test_control_planted_per_tensor_scale_is_caught(library, fp8_worker):
    """The FP8 linear with one dynamic activation scale per call (the absmax of every row) must fail
    the row check: the check can see an FP8 quantization whose scale depends on the batch."""
    with pytest.raises(BitwiseMismatch, match="rows_differing_from_largest"):
        library.check_fp8_rows(fp8_worker, "fp8_linear", list(library.fp8_sizes), variant=library.fp8_planted)
