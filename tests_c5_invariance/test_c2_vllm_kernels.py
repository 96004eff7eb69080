"""Gate C2 on the engine's own kernels (vLLM's), called directly on the GPU the way the model calls
them, through the implementation's engine kernel library (ChecksEngineKernels; for vLLM
fixtures.vllm.kernel_library over fixtures.vllm.kernel_cases): for each kernel the C0 engine
inventory maps, row r of a call over M tokens equals the same row computed alone, at
hypothesis-drawn M across the thresholds (always including 1, 7, 16, 44, 64, 255, 256, 257 and
1024 tokens), and a second call gives the same bits;
attention: a sequence alone vs inside a ragged batch, a decode query vs its prefill row, a prefill
split at any point vs unsplit - all over vLLM's paged KV cache with the backend's num_splits.

Widths are the model's (the proxy config's, i.e. the real model's on the GPU lane): narrow GEMMs
miss the variant algorithms the real model hits.

The fix pack (--vllm-fixes, docs/vllm-fixes.md): each fix's case without the fix must be red and
with it green (test_vllm_fix_rows); n/a where the installed vLLM no longer needs it.

Negative controls: the same checks in a VLLM_BATCH_INVARIANT=0 worker must see the stock GEMM
vary (or say "inconclusive"), and a planted kernel whose arithmetic changes at 64 rows must be
caught by the row check. Runs for an implementation that is ChecksEngineKernels (`--impl vllm`)
on CUDA; n/a, naming the capability, elsewhere.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from fixtures.checks import strategies as S
from fixtures.checks import workloads as W
from fixtures.core.comparison import BitwiseMismatch, assert_bitwise
from fixtures.core.contract import ChecksEngineKernels
from fixtures.core.outcomes import must_fire, not_applicable
from fixtures.runtime.scheduling import ENGINE_KERNEL_SETUP
from fixtures.runtime.run_state import STATE

pytestmark = [pytest.mark.C2, pytest.mark.gpu, pytest.mark.vllm, pytest.mark.shared_setup(ENGINE_KERNEL_SETUP)]

THRESHOLD_SIZES = list(W.TOKEN_THRESHOLDS)
CONTROL_SIZES = list(W.STOCK_CONTROL_SIZES)
_LIVE = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                       HealthCheck.too_slow])


def _row_cases(impl) -> list[str]:
    """The engine kernel library's row cases (a row is a token), controls excepted."""
    return [c for c, k in impl.engine_kernel_library().cases.items() if k.rows == "tokens" and not k.planted]


def _fixes(impl) -> list[str]:
    """The engine kernel library's fixes that have a C2 case (vLLM's fix pack, docs/vllm-fixes.md)."""
    lib = impl.engine_kernel_library()
    return [n for n, f in (getattr(lib, "fixes", None) or {}).items() if f.case]


def pytest_generate_tests(metafunc):
    """test_vllm_kernel_rows runs once per row case of the implementation's engine kernel library
    (ChecksEngineKernels), test_vllm_fix_rows once per fix with a C2 case, read at collection; an
    implementation without one gets a single `none` id, which the `library` fixture reports n/a."""
    name = metafunc.definition.originalname
    if name not in ("test_vllm_kernel_rows", "test_vllm_fix_rows"):
        return
    impl = metafunc.config.stash[STATE].impl
    ids = ["none"]
    if isinstance(impl, ChecksEngineKernels):
        ids = (_row_cases(impl) if name == "test_vllm_kernel_rows" else _fixes(impl)) or ["none"]
    metafunc.parametrize("case" if name == "test_vllm_kernel_rows" else "fix", ids)


@pytest.fixture(scope="module")
def library(engine_library):
    """The engine's own kernels as the implementation hands them over (ChecksEngineKernels)."""
    return engine_library


@pytest.fixture(scope="module")
def dims(library, proxy):
    return library.dims(json.loads((proxy.path / "config.json").read_text()))


@pytest.fixture(scope="module")
def reached(dims, engine_kernel_inventory):
    """The C2 cases the engine's kernels map to (C0 engine inventory): a case the engine never
    launches for this model is n/a, not a verdict on the model."""
    return set(engine_kernel_inventory.kernel_cases())


def require_reached(case: str, reached: set[str]) -> None:
    if case not in reached:
        not_applicable(f"the engine launched no kernel that maps to {case} for this model "
                    f"(C0 engine inventory reached: {', '.join(sorted(reached))})")


@pytest.fixture(scope="module")
def workers(library, dims, artifact_dir):
    """VLLM_BATCH_INVARIANT=1 and =0 kernel workers for this model's widths, started on demand."""
    live: dict[bool, object] = {}

    def get(batch_invariant: bool = True):
        if batch_invariant not in live:
            live[batch_invariant] = library.worker(batch_invariant=batch_invariant, dims=dims)
        return live[batch_invariant]
    yield get
    for w in live.values():
        w.close()


def test_every_inventory_case_is_checked(library):
    """The kernel table names only cases this file checks (the claim C0 relies on)."""
    named = library.rule_cases()
    assert named <= set(library.cases), f"table names unknown C2 cases: {sorted(named - set(library.cases))}"


@_LIVE
@given(sizes=st.lists(S.batch_sizes(), min_size=1, max_size=3, unique=True))
@example(sizes=THRESHOLD_SIZES).via("thresholds")
def test_vllm_kernel_rows(case, sizes, library, dims, reached, workers):
    if case not in library.cases_for(dims):
        not_applicable(f"{case} needs an MoE model (this model has no experts)")
    require_reached(case, reached)
    library.check_rows(workers(True), case, sizes)


def test_vllm_fix_rows(fix, library, dims, reached, workers, record_metric):
    """A fix of the fix pack (`--vllm-fixes`, fixtures.vllm.fixes): its C2 case in the
    batch-invariant worker must be red without the fix and green with it, at the threshold sizes
    (1 ... 1024 tokens). n/a, with the reason, where the installed vLLM no longer needs it: its
    source no longer runs the variant kernel, or its stock kernel is row-invariant at these sizes."""
    fixes = getattr(library, "fixes", None) or {}
    if fix not in fixes:
        not_applicable("the engine kernel library has no fix pack", capability=ChecksEngineKernels)
    spec = fixes[fix]
    if spec.case not in library.cases_for(dims):
        not_applicable(f"{spec.case} needs an MoE model (this model has no experts)")
    if not set(spec.reached) & reached:
        not_applicable(f"the engine launched no kernel that maps to {' or '.join(spec.reached)} for this model "
                       f"(C0 engine inventory reached: {', '.join(sorted(reached))})")
    worker = workers(True)
    need, why = (worker.info.get("fixes_needed") or {}).get(fix, (None, "not probed"))
    if need is False:
        not_applicable(f"fix {fix} not needed: {why}")
    others = tuple(n for n in library.fixes_selected() if n != fix)
    try:
        library.check_rows(worker, spec.case, THRESHOLD_SIZES, fixes=others)
    except BitwiseMismatch as exc:
        stock = str(exc).splitlines()[0][:200]
    else:
        not_applicable(f"fix {fix} not needed here: vLLM's {spec.case} without it gave every row the bits it has "
                       f"alone at {THRESHOLD_SIZES} tokens ({why})")
    library.check_rows(worker, spec.case, THRESHOLD_SIZES, fixes=others + (fix,))
    record_metric(f"fix {fix}: without it", stock)


@_LIVE
@given(lens=st.lists(st.integers(1, 700), min_size=2, max_size=6), needle=st.integers(0, 5))
@example(lens=[37, 600, 20, 300, 5], needle=0).via("needle among long and short")
def test_vllm_attention_batch(lens, needle, reached, workers):
    """A sequence's attention output alone == inside a ragged batch (paged KV cache)."""
    require_reached("attention", reached)
    needle %= len(lens)
    out = workers(True).attention("batch", lens=lens, needle=needle)
    assert_bitwise(out["lhs"], out["rhs"], what=_attention_label(out),
                   lhs_name=f"sequence {needle} in a batch of lengths {lens}", rhs_name="alone")


@_LIVE
@given(length=st.integers(1, 1500))
@example(length=257).via("past 256")
@example(length=1025).via("long")
def test_vllm_attention_decode(length, reached, workers):
    """The query of the last position decoded over the cached prefix == that row of the prefill."""
    require_reached("attention", reached)
    out = workers(True).attention("decode", lens=[length], needle=0)
    assert_bitwise(out["lhs"], out["rhs"], what=_attention_label(out),
                   lhs_name=f"decode at position {length - 1}", rhs_name="the prefill row")


@_LIVE
@given(length=st.integers(2, 1500), data=st.data())
@example(length=600, data=None).via("split 17")
def test_vllm_attention_chunked(length, data, reached, workers):
    """A prefill split at any point (the second chunk attends to the first through the cache)
    == the unsplit prefill."""
    require_reached("attention", reached)
    split = data.draw(st.integers(1, length - 1), label="split") if data is not None else 17
    out = workers(True).attention("chunked", lens=[length], needle=0, split=split)
    assert_bitwise(out["lhs"], out["rhs"], what=_attention_label(out),
                   lhs_name=f"prefill split at {split}", rhs_name="unsplit", length=length)


def _attention_label(out: dict) -> str:
    if out.get("backend") == "TRITON_ATTN":
        return "vLLM attention (Triton unified attention)"
    return f"vLLM attention (FA{out['fa_version']}, num_splits={out['num_splits']})"


# ---------------------------------------------------------------------------------------------
# negative controls
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["linear", "lm_head", "attention"])
def test_control_stock_vllm_kernels_vary(case, library, workers, record_metric):
    """With VLLM_BATCH_INVARIANT=0 the same check must see vLLM's stock kernel vary (cuBLAS on
    Hopper changes row bits from ~64 rows; FlashAttention splits KV when num_splits=0); where it
    does not, the control is inconclusive (reported, never a pass)."""
    require_case(library, case)
    stock = workers(False)
    tried = CONTROL_SIZES if case != "attention" else "ragged batches up to 1500 tokens"
    with must_fire(f"vLLM's stock {case} (VLLM_BATCH_INVARIANT=0) gave the same bits at {tried} tokens",
                   tried=tried) as control:
        if case == "attention":
            out = stock.attention("batch", lens=[37, 600, 20, 300, 5, 1500, 900], needle=0)
            assert_bitwise(out["lhs"], out["rhs"], what="stock attention", lhs_name="in a batch", rhs_name="alone")
            out = stock.attention("decode", lens=[1500], needle=0)
            assert_bitwise(out["lhs"], out["rhs"], what="stock attention", lhs_name="decode", rhs_name="prefill row")
        else:
            library.check_rows(stock, case, CONTROL_SIZES)
    record_metric(f"stock vLLM {case} control", str(control.exc).splitlines()[0][:200])


def require_case(library, case: str) -> None:
    if case not in library.cases:
        not_applicable(f"the engine kernel library has no case {case}", capability=ChecksEngineKernels)


def test_control_planted_row_split_is_caught(library, workers):
    """A planted GEMM that changes its reduction order from 64 rows (what a split-K heuristic
    does) must fail the row check in the batch-invariant worker: the check can see such a fault."""
    require_case(library, "planted_split_k_from_64")
    with pytest.raises(BitwiseMismatch):
        library.check_rows(workers(True), "planted_split_k_from_64", THRESHOLD_SIZES)


def test_control_planted_rare_rows_are_caught(library, workers):
    """A planted kernel that re-rounds only one row in 37 from 256 rows up (what a launch switch
    at a token count does to a norm: most rows keep their bits) must fail the row check: every
    row is compared, not a few probes. Measured at full depth: vLLM's fused add + RMSNorm changed
    a needle's row in a 294-token batch that three probe rows per size had not caught."""
    require_case(library, "planted_rare_rows_from_256")
    with pytest.raises(BitwiseMismatch, match="rows_differing_from_alone"):
        library.check_rows(workers(True), "planted_rare_rows_from_256", THRESHOLD_SIZES)
