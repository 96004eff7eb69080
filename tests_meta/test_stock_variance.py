"""fixtures.faults.stock_variance: the planted CPU whose stock GEMMs round by call shape - checked both
ways: a stock row differs between a 5-row and a 3-row call (the AVX-512 MKL behaviour that once
turned a self-test red), same-shape calls still agree, an inner dimension of 1 is left exact, and
the suite's own tile GEMM stays row-invariant under it."""
from __future__ import annotations

import torch

from fixtures.reference import kernels as K
from fixtures.faults.stock_variance import ShapeVariantStockGEMM


def _xw(rows=5, k=16, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)


def test_a_stock_row_depends_on_the_call_shape():
    x, w = _xw()
    with ShapeVariantStockGEMM() as mode:
        five, three = torch.nn.functional.linear(x, w), torch.nn.functional.linear(x[:3], w)
        again = torch.nn.functional.linear(x, w)
        bmm5, bmm3 = torch.bmm(x[None], w.t()[None]), torch.bmm(x[None, :3], w.t()[None])
    assert not torch.equal(five[:3], three), "the plant must make a stock row depend on the call's rows"
    assert torch.equal(five, again), "same shape, same bits: run-to-run determinism is kept"
    assert not torch.equal(bmm5[0, :3], bmm3[0])
    assert mode.calls >= 5
    exact = torch.nn.functional.linear(x, w)
    assert (five.view(torch.int32) - exact.view(torch.int32)).abs().max().item() == 1, "at most one ULP"


def test_inner_dimension_one_is_left_exact():
    x, w = _xw(k=1)
    with ShapeVariantStockGEMM():
        got = x @ w.t()
    assert torch.equal(got, x @ w.t())


def test_out_overloads_are_nudged_too():
    x, w = _xw()
    out5, out3 = torch.empty(5, 24), torch.empty(3, 24)
    with ShapeVariantStockGEMM():
        torch.mm(x, w.t(), out=out5)
        torch.mm(x[:3], w.t(), out=out3)
    assert not torch.equal(out5[:3], out3)


def test_the_suites_tile_gemm_stays_row_invariant_under_it():
    x, w = _xw(rows=70, k=48, n=40)
    with ShapeVariantStockGEMM():
        full = K.linear(x, w)
        rows = torch.cat([K.linear(x[i:i + 1], w) for i in range(x.shape[0])])
        part = K.linear(x[3:41], w)
    assert torch.equal(full, rows) and torch.equal(full[3:41], part)


def test_a_stock_row_depends_on_its_place_in_a_call():
    """The tail of a call (past its last whole micro-kernel group) rounds otherwise: a fixed tile
    height, which keeps the call shape, does not keep a row's bits where the row moves in the tile."""
    x, w = _xw(rows=32, k=16, n=24)
    with ShapeVariantStockGEMM():
        tile = torch.nn.functional.linear(x, w)
        moved = torch.nn.functional.linear(torch.cat([x[31:], x[:31]]), w)
    assert torch.equal(tile[5], moved[6]), "the same row in the head of the call keeps its bits"
    assert not torch.equal(tile[31], moved[0]), "a row moved out of the tail must change"


def test_the_suites_tile_gemm_ignores_a_rows_place():
    x, w = _xw(rows=40, k=48, n=40)
    with ShapeVariantStockGEMM():
        got = K.linear(x, w)
        rotated = K.linear(torch.cat([x[7:], x[:7]]), w)
    assert torch.equal(torch.cat([got[7:], got[:7]]), rotated)
