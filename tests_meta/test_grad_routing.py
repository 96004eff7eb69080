"""C8's model-level bound on a mixture of experts replays the trainer's expert choices
(fixtures.checks.grad_routing).

The flip these tests need is planted, not left to the CPU's rounding: a trainer whose router sends
about a third of the tokens to their (k+1)-th expert instead of their k-th - correct arithmetic,
another discrete choice (what a bf16 trainer does wherever the two logits are closer than its rounding).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fixtures.checks import grad_checks as G
from fixtures.models.proxies import build_proxy
from fixtures.reference.implementation import ReferenceImplementation


class _FlipFirstToken(TorchFunctionMode):
    """Every top-k over the experts: a token whose first expert's index is a multiple of 3 takes its
    (k+1)-th expert in place of its k-th."""

    def __init__(self, experts: int, top_k: int):
        super().__init__()
        self.experts, self.top_k = experts, top_k

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func not in (torch.topk, torch.Tensor.topk) or not isinstance(x, torch.Tensor) \
                or x.shape[-1] != self.experts or (args[1] if len(args) > 1 else kwargs.get("k")) != self.top_k:
            return func(*args, **kwargs)
        top = torch.topk(x, self.top_k + 1, dim=-1).indices
        idx = top[..., :self.top_k].clone()
        flip = top[..., 0] % 3 == 0         # a rule of the row alone, so a packed batch flips the same tokens
        idx[..., -1] = torch.where(flip, top[..., -1], idx[..., -1])
        return torch.return_types.topk((x.gather(-1, idx), idx))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    spec = build_proxy("qwen3_moe", "tiny", tmp_path_factory.mktemp("moe"))
    trainer = ReferenceImplementation().make_trainer(spec.path)
    return trainer, G.seeded_batches(spec.config.vocab_size)


def _flipping(module):
    """The trainer's kernel mode with the planted flip under it."""
    dims, mode = G.expert_dims(module), G.default_kernel_mode()

    @contextlib.contextmanager
    def flipping():
        with mode(), _FlipFirstToken(*dims):
            yield
    return flipping


def _judge(trainer, batches, trainer_mode, *, pinned: bool):
    module = trainer.module()
    routing_of = (lambda stock: G.trainer_routing(trainer, module, stock, batches, loss_fn=G.sequence_loss,
                                                  trainer_mode=trainer_mode, stock_loss=G.alone_loss)) if pinned else None
    ref = G.reference_grads(module, batches, routing_of=routing_of)
    return ref, G.check_model_grads(module, ref, G.sequence_loss, kernel_mode=trainer_mode)


def test_a_trainer_that_routes_otherwise_is_judged_on_its_own_choices(moe):
    trainer, batches = moe
    ref, rep = _judge(trainer, batches, _flipping(trainer.module()), pinned=True)
    assert "the trainer's choices at" in ref.routing and "forward's top-k" in ref.routing, ref.routing
    assert rep.ok, rep.message()


def test_control_unpinned_a_changed_choice_reads_as_a_backward_error(moe):
    """Negative control: without the replay, the same correct trainer is far over the bound."""
    trainer, batches = moe
    ref, rep = _judge(trainer, batches, _flipping(trainer.module()), pinned=False)
    assert ref.routing == ""
    assert not rep.ok and rep.max_ratio > 4, rep.message()
    assert any("experts" in n or "gate" in n for n in rep.violations), rep.violations


def test_the_replay_still_sees_a_wrong_backward(moe):
    """With the choices pinned, the planted projection gradient is still over the bound."""
    trainer, batches = moe
    module = trainer.module()
    mode = _flipping(module)
    ref, _ = _judge(trainer, batches, mode, pinned=True)
    with G.planted_in_trainer("projection_grad_scaled", module, u=ref.u) as plant:
        rep = G.check_model_grads(module, ref, G.sequence_loss, kernel_mode=mode)
    assert plant.engaged and plant.parameter in rep.violations, rep.message()


class _RecordsRouterLogits:
    """A trainer whose forward is not a torch.topk (as vLLM's fused_topk is not): its choices come
    from the router logits it records under `<layer>.mlp.gate`."""
    module_naming = "hf"

    def __init__(self, inner):
        self.inner = inner

    def module(self):
        return self.inner.module()

    def module_outputs(self, sequence, *args, **kwargs):
        out, hooks = {}, []
        for name, sub in self.module().named_modules():
            if name.endswith(".mlp.gate"):
                hooks.append(sub.register_forward_hook(
                    lambda m, a, o, name=name: out.__setitem__(name, (o[0] if isinstance(o, tuple) else o).detach())))
        try:
            with torch.no_grad():
                self.module()(input_ids=torch.tensor([list(sequence)]), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        return out


def test_router_logits_are_the_fallback_source(moe):
    trainer, batches = moe
    fake = _RecordsRouterLogits(trainer)
    module = fake.module()
    no_topk = lambda model, seqs: torch.zeros((), requires_grad=True)     # noqa: E731  (a forward that never reaches torch.topk)
    stock = G.stock_copy(module, next(module.parameters()).dtype)
    got = G.trainer_routing(fake, module, stock, batches, loss_fn=no_topk, trainer_mode=contextlib.nullcontext,
                            stock_loss=G.alone_loss)
    assert isinstance(got, G.Routing) and "router logits" in got.source, got
    assert got.calls == sum(len(b) for b in batches) * module.config.num_hidden_layers


def test_unobservable_choices_are_said_not_guessed(moe):
    trainer, batches = moe
    module = trainer.module()
    stock = G.stock_copy(module, next(module.parameters()).dtype)
    got = G.trainer_routing(trainer, module, stock, batches, loss_fn=lambda m, s: torch.zeros(()),
                            trainer_mode=contextlib.nullcontext, stock_loss=G.alone_loss)
    assert isinstance(got, str) and "could not be observed" in got and "0 router calls" in got, got
    ref = G.reference_grads(module, batches[:1], routing_of=lambda s: got)
    assert ref.routing.startswith("expert routing NOT pinned")
    assert "NOT pinned" in G.check_model_grads(module, ref, G.sequence_loss).message()


def test_a_dense_model_has_no_routing(tmp_path):
    spec = build_proxy("qwen3", "tiny", tmp_path / "dense")
    trainer = ReferenceImplementation().make_trainer(spec.path)
    module = trainer.module()
    assert G.trainer_routing(trainer, module, module, [], loss_fn=G.sequence_loss, trainer_mode=None,
                             stock_loss=G.alone_loss) == ""
