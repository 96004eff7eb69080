"""The C8 machinery itself (fixtures.checks.grad_checks): the bound passes correct backwards and fails each
planted wrong one with a message that stands alone; ops_without_backward tells an op with a
backward from one without, on synthetic ops; the determinism checks see nondeterminism."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from fixtures.checks import grad_checks as G
from fixtures.reference import kernels as K
from fixtures.core.comparison import BitwiseMismatch
from fixtures.checks.grad_checks import GradShape
from fixtures.checks.inventory import Inventory, OpEntry
from fixtures.reference.invariant_mode import batch_invariant_mode

SHAPES = (GradShape(), GradShape(rows=100, width=17, out=8, inner=3, seed=7),
          GradShape(rows=257, width=512, out=48, inner=4, seed=1), GradShape(rows=1, width=1, out=1, inner=1, seed=3))


# ---------------------------------------------------------------------------------------------
# the bound
# ---------------------------------------------------------------------------------------------
def test_bound_formula_and_constant():
    assert G.U32 == 2.0 ** -24 and G.C_BOUND == 2.0
    s = torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64)
    b = G.grad_bound(5, s)
    expect = 2.0 * 5 * (2.0 ** -24 * s + torch.finfo(torch.float32).tiny)
    assert torch.equal(b, expect)
    # a per-element n broadcasts
    b2 = G.grad_bound(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64), s)
    assert b2[2] == 2.0 * 4 * (2.0 ** -24 * 3.0 + torch.finfo(torch.float32).tiny)


def test_one_rounding_uses_half_the_bound():
    """A correctly rounded float32 result of an exact float64 value is within u|x|: ratio <= 1/2 at n = 1."""
    ref = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = ref.float()
    r = G.compare_grad("x", got, ref, 1, ref.abs(), G.C_BOUND)
    assert r.ok and 0 < r.max_ratio <= 0.5


def test_compare_names_the_worst_position():
    ref = torch.ones(3, 4, dtype=torch.float64)
    got = ref.float().clone()
    got[1, 2] = 1.0 + 2.0 ** -10
    r = G.compare_grad("w", got, ref, 4, ref.abs(), G.C_BOUND)
    assert not r.ok and r.count_over == 1 and r.position == (1, 2)
    assert r.got == 1.0 + 2.0 ** -10 and r.ref == 1.0 and r.bound == pytest.approx(8 * 2.0 ** -24)


def test_nonfinite_gradient_is_a_violation():
    ref = torch.ones(4, dtype=torch.float64)
    got = ref.float().clone()
    got[3] = float("nan")
    r = G.compare_grad("x", got, ref, 1, ref.abs(), G.C_BOUND)
    assert not r.ok and r.nonfinite == 1 and r.max_ratio == float("inf") and r.position == (3,)


@pytest.mark.parametrize("case_id", sorted(G.GRAD_CASES))
def test_correct_backward_within_bound(case_id):
    for shape in SHAPES:
        rep = G.assert_grad_within_bound(case_id, shape)
        assert rep.ok and rep.max_ratio <= 1.0
        assert len(rep.inputs) >= 1


@pytest.mark.parametrize("planted", sorted(G.PLANTED_BACKWARDS))
def test_planted_backward_fails_with_a_standalone_message(planted):
    p = G.PLANTED_BACKWARDS[planted]
    case = G.GRAD_CASES[p.case]
    for shape in SHAPES:
        with pytest.raises(G.GradBoundViolation) as info:
            G.assert_grad_within_bound(p.case, shape, backward_kernels={p.kernel: p.fn}, planted=p.name, repeats=1)
        rep = info.value.report
        assert rep.max_ratio > 1 and rep.violations
        msg = str(info.value)
        assert case.op in msg and f"case {p.case}" in msg                     # the op
        assert re.search(r"worst at position \(\d+(, \d+)*\)", msg)            # the position
        assert "got " in msg and "vs reference " in msg and "0x" in msg        # both values (+ hex)
        assert "vs bound " in msg and "n=" in msg and "S=" in msg              # the bound and its terms
        assert "c=2" in msg and "u=2^-24" in msg
        assert "VIOLATED" in msg and p.name in msg
        assert "environment:" in msg and "repro:" in msg


def test_nan_backward_is_a_violation_not_a_crash():
    nan_bw = lambda grad, out, dim=-1, input_dtype=None: grad * float("nan")   # noqa: E731
    rep = G.check_grad("softmax", GradShape(), backward_kernels={"softmax_backward": nan_bw})
    assert not rep.ok and rep.inputs[0].nonfinite == rep.inputs[0].total
    assert "non-finite" in rep.message()


def test_planted_swap_is_restored():
    before = dict(K.KERNELS)
    p = G.PLANTED_BACKWARDS["softmax_backward_drops_sum_term"]
    G.check_planted(p, GradShape())
    assert K.KERNELS == before
    with pytest.raises(RuntimeError):
        with G.planted_kernels({"matmul": p.fn}):
            assert K.KERNELS["matmul"] is p.fn
            raise RuntimeError("boom")
    assert K.KERNELS == before


def test_planted_backward_only_in_the_backward():
    """The forward of a planted case runs on the real kernels (only the backward is wrong)."""
    p = G.PLANTED_BACKWARDS["matmul_backward_scaled"]
    rep = G.check_planted(p, GradShape(rows=40))
    assert rep.served_forward.get("matmul") == 1 and rep.served_backward.get("matmul") == 2


def test_nondeterministic_backward_is_caught_run_to_run():
    with pytest.raises(BitwiseMismatch) as info:
        G.check_grad("sum", GradShape(rows=257, width=64, seed=4),
                     backward_kernels={"sum": K.VARIANTS["sum_random_order"]})
    assert "run to run" in str(info.value) and "d/dw" in str(info.value)


def test_unserved_kernel_is_reported():
    """A mode that serves nothing would compare stock torch with float64: refused."""
    with pytest.raises(G.KernelNotServed, match=r"never served \['matmul'\]"):
        G.check_grad("matmul", GradShape(), kernel_mode=lambda: batch_invariant_mode(table={}, guards=False))


def test_every_case_documents_its_shape():
    for c in G.GRAD_CASES.values():
        assert c.doc and c.op and (c.forward_kernels or c.backward_kernels)
    assert set(G.kernels_checked()) >= {"matmul", "grouped_matmul", "softmax", "softmax_backward", "log_softmax",
                                        "log_softmax_backward", "mean", "sum", "cumsum", "embedding_backward",
                                        "index_add", "conv1d", "conv1d_backward", "layer_norm",
                                        "layer_norm_backward"}


# ---------------------------------------------------------------------------------------------
# ops_without_backward on synthetic ops
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic_ops():
    """Three ops without a derivative and one with, registered once for this module."""
    lib = torch.library.Library("c8meta", "DEF")
    lib.define("raw_noback(Tensor x) -> Tensor")
    lib.impl("raw_noback", lambda x: x.detach() * 2, "CPU")          # no Autograd kernel at all

    @torch.library.custom_op("c8meta::custom_noback", mutates_args=())
    def custom_noback(x: torch.Tensor) -> torch.Tensor:              # custom_op, no register_autograd
        return x * 3

    @torch.library.custom_op("c8meta::custom_back", mutates_args=())
    def custom_back(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    custom_back.register_autograd(lambda ctx, g: g * 3)
    yield torch.ops.c8meta
    lib._destroy()


def _fn(ops, x, a):
    y = ops.raw_noback(x) + ops.custom_noback(x) + ops.custom_back(x)
    return torch.igamma(a, y.abs() + 1.0).sum() + torch.mm(x, x.t()).sum() + x.detach().sum()


def _record(ops):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, generator=g, requires_grad=True)
    a = (torch.rand(3, 3, generator=g) + 0.5).requires_grad_(True)
    rec = G.CallRecorder()
    with rec:
        _fn(ops, x, a)
    return rec.calls


def _inventory(ops_seen) -> Inventory:
    inv = Inventory(model="synthetic")
    for op in ops_seen:
        inv.ops[op] = OpEntry(op, None, phases={"train-forward"}, first_module="m")
    return inv


def test_probe_tells_missing_from_present(synthetic_ops):
    calls = _record(synthetic_ops)
    probes = {o: G.probe_backward(c) for o, c in calls.items()}
    assert "WarnNotImplemented" in probes["c8meta.raw_noback.default"].missing
    assert "no autograd formula was registered" in probes["c8meta.custom_noback.default"].missing
    assert "not implemented" in probes["aten.igamma.default"].missing
    assert probes["c8meta.custom_back.default"].missing is None
    assert probes["aten.mm.default"].missing is None
    assert probes["aten.detach.default"].missing is None and probes["aten.detach.default"].stops_gradient


def test_ops_without_backward_on_synthetic_inventory(synthetic_ops):
    calls = _record(synthetic_ops)
    inv = _inventory(sorted(calls.seen))
    missing = G.ops_without_backward(inv, calls)
    assert set(missing) == {"c8meta.raw_noback", "c8meta.custom_noback", "aten.igamma"}, missing
    assert "first in module m" in missing["aten.igamma"]
    # a recorded op the inventory does not list is still replayed, and said to be unlisted
    partial = _inventory(["aten.mm"])
    missing2 = G.ops_without_backward(partial, calls)
    assert set(missing2) == {"c8meta.raw_noback", "c8meta.custom_noback", "aten.igamma"}
    assert all(v.endswith("[not in the inventory]") for v in missing2.values())
    assert G.ops_without_backward(partial, calls, include_unlisted=False) == {}
    assert "c8meta.raw_noback" in G.unlisted_ops(partial, calls)
    # listed only for another phase: not an inventory train-forward op (replayed as unlisted only)
    inv.ops["c8meta.raw_noback"].phases = {"prefill"}
    assert "c8meta.raw_noback" not in G.ops_without_backward(inv, calls, include_unlisted=False)
    assert G.ops_without_backward(inv, calls)["c8meta.raw_noback"].endswith("[not in the inventory]")


def test_registry_fallback_without_recorded_calls(synthetic_ops):
    """Static check (no calls): catches an op with no Autograd kernel; documented to miss formulas
    that exist but raise (custom_op without register_autograd, aten not_implemented)."""
    assert G.registry_backward("c8meta.raw_noback.default") is not None
    assert G.registry_backward("aten.mm.default") is None
    assert G.registry_backward("aten.matmul.default") is None        # CompositeImplicitAutograd
    missing = G.ops_without_backward(_inventory(["c8meta.raw_noback", "aten.mm", "c8meta.custom_noback"]))
    assert set(missing) == {"c8meta.raw_noback"}


def test_seen_without_grad_needs_no_backward(synthetic_ops):
    """An op that ran in training only on inputs that do not require grad needs no backward."""
    rec = G.CallRecorder()
    with rec:
        synthetic_ops.raw_noback(torch.randn(3))
    assert not rec.calls and rec.seen["c8meta.raw_noback"] == 1
    assert G.ops_without_backward(_inventory(["c8meta.raw_noback"]), rec.calls) == {}


def test_in_place_ops_replay():
    rec = G.CallRecorder()
    x = torch.randn(4, requires_grad=True)
    with rec:
        y = x * 1
        y.mul_(2)
    assert G.probe_backward(rec.calls["aten.mul_.Tensor"]).missing is None


# ---------------------------------------------------------------------------------------------
# determinism of gradients and optimizer steps
# ---------------------------------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Parameter(torch.randn(16, width, generator=g))
        self.gain = torch.nn.Parameter(torch.randn(width, generator=g))

    def forward(self, x):
        return (x @ self.proj) * self.gain


def _tiny_loss(model, batch):
    return model(batch).pow(2).mean()


def test_grads_deterministic_passes_and_returns_grads():
    m = _Tiny()
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(1))
    res = G.grads_deterministic(m, x, loss_fn=_tiny_loss)
    assert set(res.grads) == {"proj", "gain"} and not res.without_grad
    assert m.proj.grad is None                      # the model is left without gradients


def test_grads_nondeterminism_names_the_parameter():
    # 64 gain elements, each a 300-term sum in a random order: with 8 (as before) two shuffled
    # runs gave identical bits about 1 time in 15 (measured), a flaky control; with 64 they do not.
    m = _Tiny(width=64)
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(1))
    with G.planted_kernels({"sum": K.VARIANTS["sum_random_order"]}):
        with pytest.raises(BitwiseMismatch, match="gradient of parameter gain"):
            G.grads_deterministic(m, x, loss_fn=_tiny_loss)


def test_nonfinite_grads_name_the_parameter():
    m = _Tiny()
    with torch.no_grad():
        m.gain.zero_()
    with pytest.raises(AssertionError, match=r"non-finite elements in 1 parameter\(s\): gain"):
        G.grads_deterministic(m, torch.ones(2, 16), loss_fn=lambda mod, b: torch.sqrt(mod.gain.abs()).sum())


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("optimizer", sorted(G.OPTIMIZERS))
def test_optimizer_deterministic(optimizer, foreach):
    m = _Tiny()
    res = G.model_grads(m, torch.randn(5, 16), loss_fn=_tiny_loss)
    params = dict(m.named_parameters())
    out = G.optimizer_steps_deterministic(params, res.grads, optimizer, foreach=foreach)
    assert not torch.equal(out["proj"], m.proj.detach())


@pytest.mark.parametrize("optimizer", sorted(G.OPTIMIZERS))
def test_optimizer_steps_by_parameter_group_are_the_steps_over_all(optimizer):
    """Group by group (bounded memory at real widths) gives the bits of one step over every
    parameter, for each optimizer and both foreach settings; groups keep order and never split a
    tensor."""
    from fixtures.checks.grad_determinism import parameter_groups
    m = _Tiny()
    res = G.model_grads(m, torch.randn(5, 16), loss_fn=_tiny_loss)
    params = dict(m.named_parameters())
    sizes = {n: p.numel() * p.element_size() for n, p in params.items()}
    groups = parameter_groups(params, max_bytes=min(sizes.values()))
    assert [n for g in groups for n in g] == list(params) and len(groups) == len(params)
    assert parameter_groups(params, max_bytes=sum(sizes.values())) == [list(params)]
    for foreach in (False, True):
        whole = G.optimizer_steps_deterministic(params, res.grads, optimizer, foreach=foreach, group_bytes=1 << 40)
        split = G.optimizer_steps_deterministic(params, res.grads, optimizer, foreach=foreach, group_bytes=1)
        assert all(torch.equal(whole[n], split[n]) for n in params)


def test_optimizer_nondeterminism_and_no_change_detected(monkeypatch):
    m = _Tiny()
    res = G.model_grads(m, torch.randn(5, 16), loss_fn=_tiny_loss)
    params = dict(m.named_parameters())

    class NoisySGD(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            with torch.no_grad():
                for grp in self.param_groups:
                    for p in grp["params"]:
                        p.add_(torch.randn_like(p) * 1e-6)

    monkeypatch.setitem(G.OPTIMIZERS, "noisy", lambda ps, fe: NoisySGD(ps, lr=1e-2, foreach=fe))
    for group_bytes in (1 << 30, 1):        # all at once, and one tensor at a time
        with pytest.raises(BitwiseMismatch, match="noisy"):
            G.optimizer_steps_deterministic(params, res.grads, "noisy", group_bytes=group_bytes)
    monkeypatch.setitem(G.OPTIMIZERS, "frozen", lambda ps, fe: torch.optim.SGD(ps, lr=0.0, foreach=fe))
    with pytest.raises(AssertionError, match="no parameter changed"):
        G.optimizer_steps_deterministic(params, res.grads, "frozen")


def test_float64_reference_batches_its_experts():
    """The float64 copy of an MoE module runs transformers' batched experts (eager's per-expert
    indexing writes a whole-stack zero gradient per expert: a qwen3_moe shallow reference never left
    C8's setup on the H200), the trainer-dtype copy keeps eager, and both float64 implementations
    give the same gradients to float64 rounding - the switch changes the cost, not the reference."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from fixtures.checks import grad_model
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    module = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    batch = grad_model.seeded_batches(cfg.vocab_size, seeds=(0,))[0]
    m64, m16 = grad_model.stock_copy(module, torch.float64), grad_model.stock_copy(module, torch.bfloat16)
    assert (m64.config._experts_implementation, m16.config._experts_implementation) == ("batched_mm", "eager")
    eager64 = grad_model.stock_copy(module, torch.float64)
    eager64.set_experts_implementation("eager")
    got, want = (G.model_grads(m, batch, loss_fn=grad_model.alone_loss, kernel_mode=contextlib.nullcontext).grads
                 for m in (m64, eager64))
    experts = [n for n in want if "experts" in n]
    assert experts and set(got) == set(want)
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=0, atol=1e-13 * float(want[n].abs().max())), n


@pytest.mark.parametrize("piece", [7, 1 << 26], ids=["pieces", "whole"])
def test_relative_errors_are_the_float64_formula_piece_by_piece(monkeypatch, piece):
    """C8's per-parameter error, max |g - g64| / max |g64| in float64, is the same number whether
    the kept reference is compared whole or a piece at a time on g's device: a bf16 gradient
    against a float32 reference (the GPU lane's kept gradients) and a float64 one, a parameter the
    trainer lacks (inf), and an exact one (0). The control: one changed element is seen."""
    from fixtures.checks import grad_model as GM
    monkeypatch.setattr(GM, "_PIECE", piece)
    g = torch.Generator().manual_seed(0)
    ref32 = torch.randn(5, 9, generator=g)
    got16 = (ref32 * (1 + torch.randn(5, 9, generator=g) * 1e-2)).to(torch.bfloat16)
    ref64 = torch.randn(23, generator=g, dtype=torch.float64)
    out = GM._relative_errors({"a": got16, "b": ref64.clone()}, {"a": ref32, "b": ref64, "c": ref32})
    want = float((got16.double() - ref32.double()).abs().max() / ref32.double().abs().max())
    assert out["a"] == want and out["b"] == 0.0 and out["c"] == float("inf")
    bumped = ref64.clone()
    bumped[17] += 1e-9
    assert GM._relative_errors({"b": bumped}, {"b": ref64})["b"] > 0, "control: one element changed is seen"


@pytest.mark.parametrize("error", [TypeError("cannot pickle 'generator' object"),
                                   torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB")],
                         ids=["not-copyable", "out-of-memory"])
def test_train_steps_identical_tells_an_uncopyable_trainer_from_no_room(error):
    """A trainer whose deep copy fails is NotCopyable (C8 reads n/a, with the reason); a CUDA
    out-of-memory while copying stays an out-of-memory (the plugin's rerun and report), which on the
    H200 had been read as "cannot be deep-copied"."""
    class Trainer:
        def export_weights(self):
            return {"w": torch.zeros(2)}

        def __deepcopy__(self, memo):
            raise error
    expected = G.NotCopyable if isinstance(error, TypeError) else torch.OutOfMemoryError
    with pytest.raises(expected, match="generator" if expected is G.NotCopyable else "out of memory"):
        G.train_steps_identical(Trainer(), [[1, 2, 3]], prompt_lens=[1], advantages=[1.0])
