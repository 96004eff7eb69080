"""Self-tests of the batch-invariant kernels and the mode that installs them (not a gate).

What C2 does not cover: the mode serves and counts (forward and backward), nests, leaves tracers
their ops; C0's both-ways comparison reports what it must; the registry and variants are wired as
the fault matrix expects; the elementwise guards' premise holds on this CPU; and end to end, an
unmodified tiny model of every built-in recipe gives finite logits under the mode and a sequence's
logprobs are the same bits alone and in a padded batch of 8.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.checks import kernel_checks as checks
from fixtures.core.comparison import assert_bitwise
from fixtures.reference import kernels as K
from fixtures.checks.inventory import Inventory, OpEntry, kernel_table_problems, take_inventory
from fixtures.reference.invariant_mode import BatchInvariantMode, active_mode, batch_invariant_mode, routes
from fixtures.core.kernel_table import BUILTIN, KernelPolicy, Policy, claimed_kernels
from fixtures.models.proxies import RECIPES, build_proxy
from fixtures.diagnose.tracing import OpTracer


# ---------------------------------------------------------------------------------------------
# registry and variants
# ---------------------------------------------------------------------------------------------
def test_registry_covers_the_table():
    assert set(claimed_kernels(BUILTIN)) <= set(K.KERNELS)


def test_variants_are_separate_and_target_real_kernels():
    assert set(K.VARIANTS) == set(K.VARIANT_TARGETS)
    assert not set(K.VARIANTS) & set(K.KERNELS)
    assert set(K.VARIANT_TARGETS.values()) <= set(K.KERNELS)
    assert not any(fn is kf for fn in K.VARIANTS.values() for kf in K.KERNELS.values())


def test_sum_random_order_really_varies_run_to_run():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    outs = {K.VARIANTS["sum_random_order"](x, [-1]).numpy().tobytes() for _ in range(6)}
    assert len(outs) > 1


def test_kernel_lookup_happens_at_call_time():
    """A swapped registry entry is what the mode dispatches (how planted faults work)."""
    calls = []
    original = K.KERNELS["softmax"]
    K.KERNELS["softmax"] = lambda x, dim=-1, *, dtype=None: calls.append(1) or original(x, dim, dtype=dtype)
    try:
        with batch_invariant_mode() as mode:
            torch.softmax(torch.randn(3, 5), -1)
    finally:
        K.KERNELS["softmax"] = original
    assert calls and mode.served["softmax"] == 1


# ---------------------------------------------------------------------------------------------
# the tree
# ---------------------------------------------------------------------------------------------
def test_tree_sum_is_invariant_to_zero_padding_and_shifts():
    """The halving tree groups by index residue and adds commutatively: zeros appended or
    prepended (masked keys of padded / packed batches) never change a sum."""
    g = torch.Generator().manual_seed(1)
    for n in (1, 3, 17, 37, 100):
        x = torch.randn(16, n, generator=g).exp()
        ref = K._tree_last(x)
        for before, after in ((0, 5), (3, 0), (7, 40), (31, 1)):
            padded = F.pad(x, (before, after))
            assert torch.equal(K._tree_last(padded), ref), (n, before, after)


def test_kernels_agree_with_stock_within_rounding():
    """The kernels compute the same functions as the stock ops (only the order differs)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, 50, generator=g)
    w = torch.randn(50, 20, generator=g)
    torch.testing.assert_close(K.matmul(x, w), x @ w)
    torch.testing.assert_close(K.softmax(x, -1), torch.softmax(x, -1))
    torch.testing.assert_close(K.log_softmax(x, -1), torch.log_softmax(x, -1))
    torch.testing.assert_close(K.cumsum(x, 1), torch.cumsum(x, 1))
    torch.testing.assert_close(K.silu(x), F.silu(x))
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g) for _ in range(3))
    torch.testing.assert_close(K.attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("a_shape, b_shape", [((33, 50), (50, 20)), ((6, 5, 17), (6, 17, 12)), ((6, 5, 17), (17, 12))],
                         ids=["2-D rows GEMM", "batched tree", "folded 3-D @ 2-D"])
def test_kernel_gradients_called_directly_under_autograd(a_shape, b_shape):
    """K.matmul called with tensors that require grad (C2's training variant, a trainer calling a
    kernel itself) goes through its own autograd Function: the forward keeps the no-grad bits and
    the gradients are those of the same product (against float64)."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(*a_shape, generator=g), torch.randn(*b_shape, generator=g)
    la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = K.matmul(la, lb)
    assert torch.equal(out.detach(), K.matmul(a, b)), "the forward under autograd must keep the no-grad bits"
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weight).sum().backward()
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    (torch.matmul(a64, b64) * weight.double()).sum().backward()
    torch.testing.assert_close(la.grad, a64.grad.float())
    torch.testing.assert_close(lb.grad, b64.grad.float())


# ---------------------------------------------------------------------------------------------
# LayerNorm (StarCoder2, Phi-2, GPT-NeoX; OLMo-1 without weight and bias)
# ---------------------------------------------------------------------------------------------
def _layer_norm_bw_blocks_at_256(go, x, shape, mean, rstd, w=None, b=None, mask=(True, True, True)):
    """A planted LayerNorm backward whose two row sums run left to right from 256 rows on."""
    if x.shape[0] < 256:
        return K.layer_norm_backward(go, x, shape, mean, rstd, w, b, mask)
    n = x.shape[-1]
    g = go if w is None else go * w
    xhat = (x - mean) * rstd
    seq = lambda t: sum(t.unbind(-1))[..., None]                       # noqa: E731
    gi = (g - seq(g) / n - xhat * (seq(g * xhat) / n)) * rstd
    return (gi, *K.layer_norm_backward(go, x, shape, mean, rstd, w, b, (False, mask[1], mask[2]))[1:])


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_mode_serves_layer_norm_forward_and_backward(affine):
    """F.layer_norm under the mode: aten.native_layer_norm and its backward served by the layer_norm
    kernels (weight and bias, or neither), the forward the kernel's bits, the gradients those of
    float64 LayerNorm."""
    g = torch.Generator().manual_seed(5)
    x, go = torch.randn(3, 7, 48, generator=g), torch.randn(3, 7, 48, generator=g)
    params = [torch.randn(48, generator=g) + 1, torch.randn(48, generator=g)] if affine else []
    leaves = [t.clone().requires_grad_() for t in [x, *params]]
    with batch_invariant_mode() as mode:
        y = F.layer_norm(leaves[0], (48,), *(leaves[1:] or [None, None]))
        y.backward(go)
    assert mode.served["layer_norm"] == 1 and mode.served["layer_norm_backward"] == 1, mode.served
    assert mode.served_ops[("aten.native_layer_norm_backward", "layer_norm_backward")] == 1
    assert torch.equal(y.detach(), K.layer_norm(x, [48], *(params or [None, None]))[0])
    ref = [t.double().requires_grad_() for t in [x, *params]]
    F.layer_norm(ref[0], (48,), *(ref[1:] or [None, None])).backward(go.double())
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad.float())


def test_layer_norm_kernels_agree_with_stock():
    """The LayerNorm kernels compute what aten.native_layer_norm and its backward compute (only the
    order of the sums differs), with and without weight and bias."""
    g = torch.Generator().manual_seed(6)
    x, go = torch.randn(33, 50, generator=g) * 3 + 1, torch.randn(33, 50, generator=g)
    w, b = torch.randn(50, generator=g) + 1, torch.randn(50, generator=g)
    aten = torch.ops.aten
    for wb in ((w, b), (None, None)):
        mask = [True, wb[0] is not None, wb[1] is not None]
        ours, stock = K.layer_norm(x, [50], *wb, 1e-5), aten.native_layer_norm(x, [50], *wb, 1e-5)
        for a, s in zip(ours, stock):
            torch.testing.assert_close(a.reshape(s.shape), s)
        ours_bw = K.layer_norm_backward(go, x, [50], ours[1], ours[2], *wb, mask)
        stock_bw = aten.native_layer_norm_backward(go, x, [50], stock[1], stock[2], *wb, mask)
        for a, s in zip(ours_bw, stock_bw):
            assert (a is None) == (s is None)
            if a is not None:
                torch.testing.assert_close(a, s)


def test_layer_norm_rows_are_invariant_and_planted_variants_are_caught():
    """C2's checks pass the LayerNorm kernels (forward and backward, with and without weight and
    bias) at every threshold row count, and catch a LayerNorm whose statistics (forward: the
    planted VARIANTS entry) or row sums (backward) switch to sequential blocks at 256 rows."""
    assert {c.id for c in checks.cases_for("layer_norm")} == {"layer_norm", "layer_norm-no-affine"}
    assert {c.id for c in checks.cases_for("layer_norm_backward")} == {"layer_norm_backward",
                                                                     "layer_norm_backward-no-affine"}
    assert checks.find_mismatch("layer_norm") is None
    assert checks.find_mismatch("layer_norm_backward") is None
    assert K.VARIANT_TARGETS["layer_norm_blocks_at_256_tokens"] == "layer_norm"
    for kernel, variant in (("layer_norm", K.VARIANTS["layer_norm_blocks_at_256_tokens"]),
                            ("layer_norm_backward", _layer_norm_bw_blocks_at_256)):
        err = checks.find_mismatch(kernel, variant)
        assert err is not None, f"a {kernel} switching to sequential sums at 256 rows passed C2's checks"
        assert "256-row" in str(err) or "rows: 256" in str(err) or "rows: 257" in str(err), str(err)


def test_guard_premise_holds_on_this_cpu():
    """The elementwise guards are built from exp, log1p, erf, tanh and + - * /, assuming their SIMD
    and scalar paths round alike here (they do on AVX2 / AVX-512 with PyTorch's Sleef builds). A
    strided view forces the scalar path."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(1 << 16, generator=g) * 3, (torch.rand(1 << 16, generator=g) - 0.5) * 60])
    strided = torch.stack([x, torch.zeros_like(x)], 1)[:, 0]
    for name, f in [("exp", torch.exp), ("log1p", lambda t: torch.log1p(t.abs())), ("erf", torch.erf),
                    ("tanh", torch.tanh), ("silu guard", K.silu), ("sigmoid guard", K.sigmoid),
                    ("softplus guard", K.softplus), ("gelu guard", K.gelu)]:
        assert torch.equal(f(x), f(strided)), f"{name}: SIMD and scalar paths differ on this CPU"


# ---------------------------------------------------------------------------------------------
# the mode
# ---------------------------------------------------------------------------------------------
def test_mode_serves_and_counts_forward_and_backward():
    a = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    with batch_invariant_mode() as mode:
        y = torch.log_softmax(a @ w, -1)
        y.sum().backward()
    assert mode.served["matmul"] == 3, mode.served          # forward mm + two in MmBackward
    assert mode.served["log_softmax"] == 1 and mode.served["log_softmax_backward"] == 1
    assert mode.served_ops[("aten.mm", "matmul")] == 3
    assert "aten.mm" not in mode.passed_through and mode.passed_through  # the rest ran stock
    assert torch.isfinite(a.grad).all() and torch.isfinite(w.grad).all()


def test_mode_forward_bits_same_with_and_without_autograd():
    x = torch.randn(40, 16)
    w = torch.randn(16, 8, requires_grad=True)
    with batch_invariant_mode():
        with torch.no_grad():
            ref = torch.softmax(F.silu(x @ w), -1)
        out = torch.softmax(F.silu(x @ w), -1)
    assert torch.equal(ref, out.detach())


def test_mode_unsupported_arguments_run_stock_and_are_counted():
    x = torch.randn(1, 2, 8, 8)
    w = torch.randn(3, 2, 3, 3)
    with batch_invariant_mode() as mode:
        F.conv2d(x, w)                               # a 2-D conv: not a conv1d kernel case
    assert mode.unsupported["aten.convolution.default"] == 1
    assert mode.passed_through["aten.convolution"] == 1


def test_nested_mode_is_a_no_op_and_tracers_inside_see_model_ops():
    lin = torch.nn.Linear(8, 4)
    with batch_invariant_mode() as outer:
        with OpTracer(lin) as tracer:
            with batch_invariant_mode() as inner:
                assert inner is outer and active_mode() is outer
                lin(torch.randn(3, 8))
    ops = [e.op for e in tracer.trace.events]
    assert "aten.addmm" in ops and "aten.cat" not in ops, ops   # the model's op, not the kernel's
    assert outer.served["matmul"] == 1
    assert active_mode() is None


def test_routes_follow_the_table():
    r = routes(BUILTIN)
    assert r["aten.mm"] == "matmul" and r["aten._softmax"] == "softmax"
    assert r["aten.silu"] == "silu"                   # a guard, claimed by the table itself
    assert routes(BUILTIN, guards=False)["aten.silu"] == "silu"
    without = {k: v for k, v in BUILTIN.items() if k != "aten.silu"}   # a table that does not claim it
    assert routes(without)["aten.silu"] == "silu" and "aten.silu" not in routes(without, guards=False)


# ---------------------------------------------------------------------------------------------
# C0 both ways: the comparison reports what it must
# ---------------------------------------------------------------------------------------------
def _inv(served, unserved, policy=KernelPolicy(Policy.KERNEL, "matmul")):
    inv = Inventory(model="m", kernel_mode="test")
    inv.ops["aten.mm"] = OpEntry("aten.mm", policy, {"prefill"}, {"Linear"}, "layers.0.q_proj", 3)
    inv.served, inv.unserved = served, unserved
    return inv


def test_both_ways_problems():
    assert kernel_table_problems(_inv({"aten.mm": {"matmul": 3}}, {})) == ([], [])
    problems, _ = kernel_table_problems(_inv({}, {"aten.mm": 3}))
    assert any("never dispatched" in p and "Linear" in p and "'matmul'" in p for p in problems), problems
    assert any("slipped through" in p for p in problems), problems
    problems, _ = kernel_table_problems(_inv({"aten.mm": {"softmax": 3}}, {}))
    assert any("served it with {'softmax': 3}" in p for p in problems), problems
    problems, notes = kernel_table_problems(_inv({"aten.mm": {"silu": 3}}, {}, KernelPolicy(Policy.ELEMENTWISE)))
    assert not problems and notes


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_proxy("llama", "tiny", tmp_path_factory.mktemp("llama")).path


def test_both_ways_catches_an_op_the_mode_does_not_serve(llama_dir):
    """A mode that lacks aten.mm (the stock GEMM runs) fails the both-ways check, naming the op,
    the module class and the claimed kernel."""
    from fixtures.models.proxies import load_model
    model = load_model(llama_dir)
    table = dict(BUILTIN)
    mode_table = {k: v for k, v in table.items() if k != "aten.mm"}
    inv = take_inventory(model, "llama", vocab_size=512, table=table, prompt_len=6, decode_steps=1,
                         kernel_mode=lambda: BatchInvariantMode(mode_table))
    problems, _ = kernel_table_problems(inv)
    assert any(p.startswith("aten.mm:") and "Linear" in p and "'matmul'" in p for p in problems), problems


# ---------------------------------------------------------------------------------------------
# end to end: unmodified tiny models under the mode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sequence_alone_equals_in_padded_batch_of_8(recipe, tmp_path):
    """Under the mode, an unmodified model gives finite logits, and a sequence's logprobs are the
    same bits alone and at any row of a right-padded batch of 8 (the trainer's padded layout);
    forward bits are the same with autograd on."""
    from fixtures.reference.hf_trainer import HFTrainer
    spec = build_proxy(recipe, "tiny", tmp_path / recipe)
    trainer = HFTrainer(spec.path, kernel_mode=batch_invariant_mode)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 40, (8,), generator=g).tolist()
    seqs = [torch.randint(1, spec.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    with batch_invariant_mode():
        logits = trainer.module()(input_ids=torch.tensor([seqs[0]])).logits
    assert torch.isfinite(logits).all()
    batch = trainer.logprobs(seqs)
    for i, s in enumerate(seqs):
        alone = trainer.logprobs([s])[0]
        assert_bitwise(alone, batch[i], what=f"{recipe}: sequence {i} alone vs in a padded batch of 8",
                              lhs_name="alone", rhs_name="in batch")
    with_grad = trainer.logprobs_with_grad(seqs[:3])
    for i in range(3):
        assert_bitwise(batch[i], with_grad[i].detach(), what=f"{recipe}: no_grad vs autograd forward",
                              lhs_name="no_grad", rhs_name="with grad")
