"""Gate C2 - Kernel invariance: every kernel of the table, as the implementation provides it
(ProvidesKernels: `impl.kernel_library()`; n/a for an implementation without one), on
hypothesis-drawn shapes and row counts across the thresholds (1, 2, 7, 16, 44, 64, 255, 256, 257,
1024): row i of f(X) equals f(X[i:i+1]); a row permutation permutes the bits; run to run the same
bits; attention: a decode query equals the prefill row, any chunked-prefill split equals the
unsplit prefill, a packed ragged batch equals each sequence alone; the training variant (autograd
on, packed input) gives the inference variant's forward bits.

Negative controls: the same checks on the stock torch op must report a difference (or the control
is "inconclusive on this hardware"), and every planted variant (fixtures.checks.controls: the
reference library's deliberately variant kernels) must be caught. The checks themselves live in
fixtures.checks.kernel_checks (the fault matrix reuses them).

Kernels run on the implementation's device (`impl.device()`).
"""
from __future__ import annotations

import re

import pytest
from hypothesis import example, given, note, strategies as st

from fixtures.checks import controls
from fixtures.checks import kernel_checks as checks
from fixtures.checks import strategies as S
from fixtures.checks import workloads as W
from fixtures.core.contract import ProvidesKernels
from fixtures.core.kernel_table import BUILTIN, claimed_kernels
from fixtures.core.outcomes import control_fired, inconclusive, not_applicable
from fixtures.checks.strategies import AttnShape, Shape

pytestmark = pytest.mark.C2

ROW_CASES = sorted(checks.CASES)
BIG = Shape(width=64, out=16, inner=2, seed=11)
ODD = Shape(width=13, out=13, inner=3, seed=12)


@pytest.fixture(scope="module")
def kernels(impl):
    """The kernels under test: the implementation's kernel library (ProvidesKernels), kernel
    name -> callable, looked up when each check runs (a planted kernel fault is what is checked).
    The controls below take it too: they show these checks can see a fault, so without the
    library they are n/a with the checks."""
    if not isinstance(impl, ProvidesKernels):
        not_applicable(f"the implementation is not ProvidesKernels ({impl.name} has no kernel_library(): no "
                       "kernel to call row by row)", capability=ProvidesKernels)
    return impl.kernel_library()


@pytest.fixture(scope="module")
def device(impl):
    """The device the implementation runs on; C2 checks its kernels there."""
    return impl.device()


def impl_kernel(kernels, name: str):
    """The implementation's kernel `name` (n/a where its library has none)."""
    if name not in kernels:
        not_applicable(f"the implementation's kernel library has no {name!r} kernel", capability=ProvidesKernels)
    return kernels[name]


def case_kernel(kernels, case: str):
    return impl_kernel(kernels, checks.CASES[case].kernel)


def test_every_table_kernel_has_a_kernel_and_checks(impl, kernels):
    """Every kernel the table names is in the implementation's kernel library and has a C2 case."""
    table = impl.kernel_table() or BUILTIN
    claimed = claimed_kernels(table)
    missing = {k: sorted(ops) for k, ops in claimed.items() if k not in kernels}
    assert not missing, f"kernels named by the table but absent from the implementation's kernel_library(): {missing}"
    unchecked = sorted(k for k in claimed if not checks.cases_for(k))
    assert not unchecked, f"kernels without a C2 case in fixtures.checks.kernel_checks.CASES: {unchecked}"


# ---------------------------------------------------------------------------------------------
# per kernel: rows, permutation, run to run, training variant
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ROW_CASES)
@given(rows=S.batch_sizes(), shape=S.kernel_shapes(), data=st.data())
@example(rows=1, shape=BIG, data=None).via("threshold")
@example(rows=257, shape=BIG, data=None).via("threshold")
@example(rows=1024, shape=ODD, data=None).via("threshold")
def test_row_independence(case, rows, shape, data, kernels, device):
    """Row i of f(X) equals f(X[i:i+1]) (index kernels: a target's result equals its own
    contributions alone); a sub-batch equals the same rows of the full call."""
    extra = data.draw(S.extra_probe_rows(rows), label="extra probe rows") if data is not None else []
    note(f"case {case}: {checks.CASES[case].doc}")
    checks.check_rows(case, case_kernel(kernels, case), rows=rows, shape=shape, device=device, extra_probes=extra)


@pytest.mark.parametrize("case", ROW_CASES)
@given(rows=S.batch_sizes(), shape=S.kernel_shapes(), seed=S.seeds())
@example(rows=64, shape=BIG, seed=0).via("threshold")
@example(rows=256, shape=ODD, seed=1).via("threshold")
def test_row_permutation(case, rows, shape, seed, kernels, device):
    """f(X[perm]) == f(X)[perm] bit for bit."""
    note(f"case {case}: {checks.CASES[case].doc}")
    checks.check_permutation(case, case_kernel(kernels, case), rows=rows, shape=shape, device=device, seed=seed)


@pytest.mark.parametrize("case", ROW_CASES)
@given(rows=S.batch_sizes(), shape=S.kernel_shapes())
@example(rows=44, shape=BIG).via("threshold")
def test_run_to_run(case, rows, shape, kernels, device):
    """The same call three times gives the same bits (all outputs)."""
    checks.check_repeat(case, case_kernel(kernels, case), rows=rows, shape=shape, device=device)


@pytest.mark.parametrize("case", [c for c in ROW_CASES if c != "segment_reduce"])
@given(rows=S.batch_sizes(), shape=S.kernel_shapes())
@example(rows=16, shape=BIG).via("threshold")
def test_training_variant(case, rows, shape, kernels, device):
    """With autograd recording, the forward bits equal the no-grad call; the backward is finite."""
    checks.check_training_variant(case, case_kernel(kernels, case), rows=rows, shape=shape, device=device)


@pytest.mark.parametrize("case", ["softmax", "matmul-bmm"])
@given(rows=S.batch_sizes(), shape=S.kernel_shapes(), extra=st.integers(1, 70))
@example(rows=7, shape=BIG, extra=64).via("threshold")
def test_masked_keys_do_not_change_a_row(case, rows, shape, extra, kernels, device):
    """Eager attention's softmax and P @ V: masked keys appended (padded batch, longer cache) or
    prepended (packed batch) leave every row's bits unchanged."""
    checks.check_masked_extension(case, case_kernel(kernels, case), rows=rows, shape=shape, device=device, extra=extra)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
@given(shape=S.attention_shapes(), data=st.data())
@example(shape=AttnShape(batch=2, seq_len=70, heads=4, kv_heads=2, head_dim=16, seed=1), data=None).via("blocks")
def test_attention_decode_equals_prefill_row(shape, data, kernels, device):
    """One decode query at position p against a cache of p+1 keys == row p of the prefill."""
    positions = data.draw(S.decode_positions(shape.seq_len), label="positions") if data is not None else \
        [0, 1, 31, 32, 33, 63, 64, 69]
    checks.check_attention_decode(impl_kernel(kernels, "attention"), shape=shape, positions=positions, device=device)


@given(shape=S.attention_shapes(), data=st.data())
@example(shape=AttnShape(batch=1, seq_len=96, heads=2, kv_heads=1, head_dim=8, seed=2), data=None).via("blocks")
def test_attention_chunked_prefill_equals_unsplit(shape, data, kernels, device):
    """Any chunked-prefill split (chunks of queries against all keys so far) == the unsplit prefill."""
    splits = data.draw(S.prefill_splits(shape.seq_len), label="splits") if data is not None else [1, 31, 32, 33, 64]
    checks.check_attention_chunked(impl_kernel(kernels, "attention"), shape=shape, splits=splits, device=device)


@given(shape=S.attention_shapes(max_len=8), lens=S.packed_lengths())
@example(shape=AttnShape(heads=4, kv_heads=2, head_dim=16, seed=3), lens=[1, 33, 70, 5]).via("blocks")
def test_attention_packed_ragged_equals_alone(shape, lens, kernels, device):
    """Sequences packed into one ragged batch (attention_varlen) == each sequence alone."""
    checks.check_attention_packed(impl_kernel(kernels, "attention"), lens=lens, shape=shape, device=device)


@given(shape=S.attention_shapes(max_len=8), lens=S.packed_lengths())
@example(shape=AttnShape(heads=2, kv_heads=1, head_dim=8, seed=4), lens=[40, 3, 64]).via("blocks")
def test_attention_training_variant_equals_inference(shape, lens, kernels, device):
    """Training variant (packed, autograd on, backward run) == inference variant (alone, no grad)."""
    checks.check_attention_training(impl_kernel(kernels, "attention"), lens=lens, shape=shape, device=device)


# ---------------------------------------------------------------------------------------------
# conv (Mamba)
# ---------------------------------------------------------------------------------------------
@given(rows=st.sampled_from((1, 2, 7)), shape=S.kernel_shapes(), split=st.integers(1, 24))
def test_conv1d_prefix_equals_chunked(rows, shape, split, kernels, device):
    """The causal conv of a prefix == the prefix of the conv (a chunked Mamba prefill)."""
    checks.check_conv_prefix(impl_kernel(kernels, "conv1d"), rows=rows, shape=shape, split=split, device=device)


@given(rows=st.sampled_from((1, 2, 7)), shape=S.kernel_shapes())
def test_conv1d_equals_decode_steps(rows, shape, kernels, device):
    """Every conv step == Mamba's decode step sum(conv_state * w, -1) + bias (same taps, same tree)."""
    checks.check_conv_decode_step(impl_kernel(kernels, "conv1d"), rows=rows, shape=shape, device=device)


# ---------------------------------------------------------------------------------------------
# negative controls
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", sorted(checks.STOCK))
def test_stock_kernel_control(kernel, kernels, device, record_metric):
    """The same checks on the stock torch op must see a difference where this hardware makes the
    stock op variant; where it does not, the control is inconclusive (reported, never a pass)."""
    rows, widths = ", ".join(map(str, W.BATCH_THRESHOLDS)), f"{checks.CONTROL_SHAPE.width}, {checks.ODD_SHAPE.width}"
    tried = f"stock {checks.STOCK_NAMES.get(kernel, kernel)} at rows {rows}, widths {widths}"
    try:
        fired = checks.stock_control(kernel, device=device)
    except checks.StockUnavailable as exc:
        inconclusive(str(exc), tried=tried)
    if fired is None:
        inconclusive(f"stock {checks.STOCK_NAMES.get(kernel, kernel)} showed no difference on {device} at rows {rows} "
                     f"(widths {widths})", tried=tried)
    control_fired(fired)
    record_metric(f"stock control {kernel}", fired)


@pytest.mark.parametrize("variant", sorted(controls.PLANTED_VARIANTS))
def test_planted_variant_is_caught(variant, kernels, device):
    """Each deliberately variant kernel, in place of the kernel it targets, fails C2's checks."""
    target = controls.PLANTED_TARGETS[variant]
    err = checks.find_mismatch(target, controls.PLANTED_VARIANTS[variant], device=device)
    assert err is not None, (f"planted variant {variant!r} (in place of kernel {target!r}) passed every C2 check "
                             f"at rows {W.BATCH_THRESHOLDS}: the checks of {target!r} cannot see this fault")


@pytest.mark.parametrize("threshold", list(W.SPLIT_K_THRESHOLDS))
def test_split_k_variant_caught_at_any_threshold(threshold, kernels, device):
    """A matmul that switches algorithm at `threshold` rows is caught wherever the threshold lies."""
    err = checks.find_mismatch("matmul", controls.split_k_variant(threshold), device=device,
                               shapes=(checks.CONTROL_SHAPE,))
    assert err is not None, f"matmul switching to split-K at {threshold} rows passed C2's matmul checks"
    # caught because the threshold was crossed: the failing call had at least `threshold` rows
    rows = re.search(r"(\d+)-row|rows: (\d+)", str(err))
    assert rows and int(rows.group(1) or rows.group(2)) >= threshold, str(err)
