"""C8's float64 optimizer step (fixtures.checks.optimizer_step): its closed-form first steps are
torch.optim's algorithms (each spec's own torch optimizer, stepped in float64, lands on them), and
the contract's OptimizerSpec refuses what it cannot declare."""
from __future__ import annotations

import pytest
import torch

from fixtures.checks.optimizer_step import C_UPDATE, C_W, first_step
from fixtures.core.contract import OptimizerSpec

SPECS = [
    OptimizerSpec("sgd", lr=1e-2),
    OptimizerSpec("sgd", lr=3e-2, weight_decay=0.1, momentum=0.9, dampening=0.5),
    OptimizerSpec("sgd", lr=3e-2, weight_decay=0.1, momentum=0.9, nesterov=True),
    OptimizerSpec("adam", lr=1e-3, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6),
    OptimizerSpec("adamw", lr=1e-2, weight_decay=0.01),
    OptimizerSpec("adamw", lr=1e-2, weight_decay=0.0, eps=1e-3),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_first_step_is_torch_optims(spec):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 48, generator=gen, dtype=torch.float64) * 0.05
    g = torch.randn(64, 48, generator=gen, dtype=torch.float64) * torch.logspace(-9, 0, 48, dtype=torch.float64)
    g[0, :4] = 0.0                                    # a zero gradient: Adam's eps alone
    leaf = w0.clone().requires_grad_(True)
    opt = spec.make([leaf])
    leaf.grad = g.clone()
    opt.step()
    update = first_step(spec, w0, g)
    u64 = torch.finfo(torch.float64).eps / 2         # torch's float64 step, held to C8's own bound in float64's u
    err = (leaf.detach() - (w0 + update)).abs()
    assert (err <= C_W * u64 * w0.abs() + C_UPDATE * u64 * update.abs()).all(), float(err.max())
    assert (update != 0).any()


@pytest.mark.parametrize("bad", [dict(name="lion", lr=1e-3), dict(name="sgd", lr=0.0),
                                 dict(name="adamw", lr=1e-3, momentum=0.9)])
def test_spec_refuses_what_it_cannot_declare(bad):
    with pytest.raises(ValueError):
        OptimizerSpec(**bad)
