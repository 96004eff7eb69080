"""The one comparison helper: bitwise semantics and a failure message that stands alone."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fixtures.core.comparison import (BitwiseMismatch, assert_bitwise, compare, expecting_mismatch, float_hex,
                                     parity_metrics, ulp_distance)


def test_equal_bits_pass():
    a = torch.tensor([-1.5, -0.25, -3.0])
    assert_bitwise(a, a.clone())
    assert_bitwise([a, a[:2]], [a.clone(), a[:2].clone()])


def test_one_ulp_fails_with_hex_and_ulp():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    b = a.clone()
    b[1, 2] = torch.nextafter(b[1, 2], torch.tensor(0.0))
    with pytest.raises(BitwiseMismatch) as info:
        assert_bitwise(a, b, what="sampled logprobs", lhs_name="alone", rhs_name="in batch", batch_size=64)
    msg = str(info.value)
    assert "sampled logprobs: alone != in batch" in msg
    assert "sequence 1, token 2" in msg
    assert float_hex(a[1, 2]) in msg and float_hex(b[1, 2]) in msg
    assert "1 ULP apart" in msg
    assert "differing positions: 1 of 6" in msg
    assert "batch_size: 64" in msg
    assert "environment:" in msg and "repro: pytest" in msg
    assert "what to do: docs/porting-guide.md" in msg
    assert info.value.diff.first == (1, 2) and info.value.diff.ulp == 1


def test_a_failure_points_to_its_gates_porting_guide_section():
    from fixtures.core import environment
    before = dict(environment._current)
    environment.set_current_test("tests_c5_invariance/test_c3_engine_batch.py::t", {"gate": "C3"})
    try:
        with pytest.raises(BitwiseMismatch) as info:
            assert_bitwise(torch.zeros(2), torch.ones(2), what="x")
        assert "what to do: docs/porting-guide.md#c3-engine-batch-invariance (C3)" in str(info.value)
    finally:
        environment._current.update(before)


def test_nan_never_passes():
    a = torch.tensor([float("nan"), -1.0])
    with pytest.raises(BitwiseMismatch):
        assert_bitwise(a, a.clone())


def test_structural_mismatches():
    a = torch.zeros(3)
    assert "3 tokens vs 2" in compare(a, torch.zeros(2)).structural
    assert "dtype" in compare(a, a.double()).structural
    assert "sequences" in compare([a, a], [a]).structural
    with pytest.raises(BitwiseMismatch, match="structural"):
        assert_bitwise(a, a.to(torch.bfloat16))


_SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0]


@given(rows=st.integers(1, 9), cols=st.integers(1, 7), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       changes=st.lists(st.tuples(st.integers(0, 62), st.sampled_from(["ulp", "special", "value"]),
                                  st.sampled_from(_SPECIALS)), max_size=6),
       piece=st.integers(1, 20))
@settings(max_examples=150, deadline=None)
def test_a_whole_tensor_differs_as_its_rows_do(rows, cols, dtype, changes, piece):
    """compare() of two same-shape tensors (computed where they live, a piece of rows at a time)
    gives the Difference the row-by-row loop gives (a list of the rows), NaN, infinities and -0.0
    included, at any piece size."""
    g = torch.Generator().manual_seed(rows * 100 + cols)
    a = (torch.randn(rows, cols, generator=g) * 4).to(dtype)
    b = a.clone()
    for at, kind, special in changes:
        r, c = divmod(at % (rows * cols), cols)
        if dtype == torch.int64:
            b[r, c] += 1
        elif kind == "ulp":
            b[r, c] = torch.nextafter(b[r, c].float(), torch.tensor(math.inf)).to(dtype)
        elif kind == "special":
            b[r, c] = special
        else:
            a[r, c] = special
    with _pieces_of(piece):
        whole = compare(a, b)
    loop = compare(list(a), list(b))
    for field in ("count", "total", "first", "lhs_hex", "rhs_hex", "ulp", "first_sequence_absdiff"):
        assert repr(getattr(whole, field)) == repr(getattr(loop, field)), field
    assert repr(whole.max_abs) == repr(loop.max_abs)
    assert repr((whole.lhs_value, whole.rhs_value)) == repr((loop.lhs_value, loop.rhs_value))
    flat = compare(a.reshape(-1), b.reshape(-1))      # one row: the loop's [x]
    assert (flat.count, flat.total) == (loop.count, loop.total)


@contextlib.contextmanager
def _pieces_of(elements: int):
    from fixtures.core import comparison
    old, comparison._PIECE_ELEMENTS = comparison._PIECE_ELEMENTS, elements
    try:
        yield
    finally:
        comparison._PIECE_ELEMENTS = old


def test_a_whole_tensor_difference_control():
    """Control of the equivalence above: a change the loop sees, the whole-tensor path sees too
    (one element of the last row of a 3-D tensor, in the last piece)."""
    a = torch.zeros(5, 3, 4)
    b = a.clone()
    b[4, 2, 3] = 1.0
    with _pieces_of(12):
        d = compare(a, b)
    assert (d.count, d.first, d.max_abs, d.total) == (1, (4, 11), 1.0, 60)


def test_ulp_distance_across_zero_and_signs():
    z, nz = torch.tensor([0.0]), torch.tensor([-0.0])
    tiny = torch.tensor([1.4e-45])  # smallest float32 subnormal
    assert ulp_distance(z, nz).item() == 0
    assert ulp_distance(tiny, -tiny).item() == 2
    one = torch.tensor([1.0])
    assert ulp_distance(one, torch.nextafter(one, torch.tensor([2.0]))).item() == 1
    assert ulp_distance(torch.tensor([float("nan")]), one).item() == torch.iinfo(torch.int64).max
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert ulp_distance(b, torch.tensor([1.0078125], dtype=torch.bfloat16)).item() == 1


def test_float_hex():
    assert float_hex(torch.tensor(1.0)) == "0x3f800000"
    assert float_hex(torch.tensor(-2.0)) == "0xc0000000"
    assert float_hex(torch.tensor(1.0, dtype=torch.bfloat16)) == "0x3f80"


def test_localisation_is_called_only_on_mismatch():
    calls = []
    loc = lambda: calls.append(1) or "model.layers.1.mlp.down_proj aten.mm"
    assert_bitwise(torch.ones(2), torch.ones(2), localise=loc)
    assert not calls
    with pytest.raises(BitwiseMismatch, match="first diverging op: model.layers.1.mlp.down_proj aten.mm"):
        assert_bitwise(torch.ones(2), torch.zeros(2), localise=loc)
    broken = lambda: 1 / 0
    with pytest.raises(BitwiseMismatch, match="localisation failed: ZeroDivisionError"):
        assert_bitwise(torch.ones(2), torch.zeros(2), localise=broken)


def test_an_expected_mismatch_still_raises_but_runs_no_diagnosis():
    """A negative control's comparison (expecting_mismatch) fails as ever, with the difference, and
    neither diagnoses nor localises it; an equal pair still passes inside, and outside the block
    (the control) both run again."""
    calls = []
    loc = lambda: calls.append("localise") or "an op"
    diag = lambda d: calls.append("diagnose") or "a convention"
    with expecting_mismatch():
        assert_bitwise(torch.ones(2), torch.ones(2), localise=loc, diagnose=diag)
        with pytest.raises(BitwiseMismatch, match="differing positions: 1 of 2") as info:
            assert_bitwise(torch.ones(2), torch.tensor([1.0, 0.0]), localise=loc, diagnose=diag)
    assert calls == [] and info.value.diff.count == 1
    assert "not run: a negative control" in str(info.value)
    with pytest.raises(BitwiseMismatch, match="first diverging op: an op"):
        assert_bitwise(torch.ones(2), torch.zeros(2), localise=loc, diagnose=diag)
    assert calls == ["diagnose", "localise"]


def test_a_cuda_fault_in_a_diagnosis_is_an_error_not_a_diagnosis_note():
    """A diagnosis that fails says so in the message - except a CUDA fault, which poisons the
    process: it is raised as this check's error, with the difference it was diagnosing."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])

    def broken(_):
        raise RuntimeError("oops")
    with pytest.raises(BitwiseMismatch, match=r"diagnosis failed: RuntimeError: oops"):
        assert_bitwise(a, b, diagnose=broken)

    class AcceleratorError(RuntimeError):      # torch's name for a device fault (torch >= 2.8)
        pass

    def faulting(*_):
        raise AcceleratorError("CUDA error: an illegal memory access was encountered")
    for kw in ({"diagnose": faulting}, {"localise": faulting}):
        with pytest.raises(RuntimeError, match=r"hit a CUDA fault \(AcceleratorError: CUDA error: an illegal memory") as e:
            assert_bitwise(a, b, **kw)
        assert not isinstance(e.value, BitwiseMismatch) and "first difference at sequence 0, token 1" in str(e.value)


def test_parity_metrics_exact_and_not():
    e = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    m = parity_metrics(e, [t.clone() for t in e])
    assert m.exact and m.tokens == 3
    t = [torch.tensor([-1.0, -2.5]), torch.tensor([-0.5])]
    m = parity_metrics(e, t)
    assert not m.exact
    assert m.max_abs_diff == 0.5 and math.isclose(m.mismatch_fraction, 1 / 3)
    assert math.isclose(m.k1, 0.5 / 3)
    assert math.isclose(m.k3, (math.expm1(-0.5) + 0.5) / 3)
    with pytest.raises(ValueError):
        parity_metrics(e, t[:1])
