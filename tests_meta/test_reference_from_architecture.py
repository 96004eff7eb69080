"""C8's float64 reference is the model the config defines, holding the trainer's weights
(fixtures.checks.grad_model.architecture_copy), not a copy of the trainer's module: a wrong
backward installed by replacing a submodule is not in the reference, so the model-level bound
sees it. Control: the old reference (a deep copy of the module) inherits the replacement and
agrees with the wrong gradient."""
from __future__ import annotations

import torch

from fixtures.checks import grad_model as G
from fixtures.models.proxies import build_proxy, load_model


class _DoubledBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return 2 * g * s * (1 + x * (1 - s))      # twice SiLU's derivative


class _WrongSiLU(torch.nn.Module):
    """SiLU's forward bits, a wrong backward: what a fused activation with a bad backward looks like."""

    def forward(self, x):
        return _DoubledBackward.apply(x)


def _module(tmp_path):
    model = load_model(build_proxy("llama", "tiny", tmp_path / "p").path, dtype=torch.float32).train()
    model.model.layers[0].mlp.act_fn = _WrongSiLU()
    return model


def test_the_reference_is_the_architecture_not_the_module(tmp_path):
    module = _module(tmp_path)
    ref = G.architecture_copy(module, torch.float64)
    assert ref is not None and not isinstance(ref.model.layers[0].mlp.act_fn, _WrongSiLU)
    assert all(torch.equal(p.to(torch.float32), module.state_dict()[n]) for n, p in ref.state_dict().items())
    assert ref.lm_head.weight is ref.model.embed_tokens.weight or not module.config.tie_word_embeddings


def test_a_replaced_submodule_with_a_wrong_backward_exceeds_the_bound(tmp_path, monkeypatch):
    module = _module(tmp_path)
    batches = G.seeded_batches(module.config.vocab_size)[:1]
    rep = G.check_model_grads(module, G.reference_grads(module, batches), G.alone_loss)
    assert not rep.ok, "the architecture's reference did not see the replaced submodule's backward"
    # control: with the reference a copy of the module (the old way), the wrong backward agrees with itself
    monkeypatch.setattr(G, "architecture_copy", lambda m, dtype, device=None, **kw: None)
    old = G.check_model_grads(module, G.reference_grads(module, batches), G.alone_loss)
    assert old.ok, "control: a reference copied from the module should inherit the replacement"
