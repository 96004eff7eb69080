"""Gate C8 - Backward alignment: every op in the inventory has a backward; gradients are run-to-run
bitwise deterministic and finite; each op's gradient agrees with a float64 autograd reference
within a per-op bound derived from the dtype and reduction length (a planted wrong backward must
exceed it); the optimizer step is deterministic.

The bound and its constant are documented in fixtures.checks.grad_checks: |g - g64| <= 2 * n * u * S,
u = 2^-24, n the reduction length of the backward computation, S the elementwise magnitude.
Everything runs under the implementation's kernel mode (HasKernelMode: `impl.kernel_mode()`;
where it has none, fixtures.checks.grad_checks.default_kernel_mode, the reference batch-invariant
mode): forward and backward on its kernels.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, note, settings

from fixtures.checks import grad_checks as G
from fixtures.checks.workloads import random_sequences
from fixtures.checks.grad_checks import GradShape
from fixtures.core.contract import HasKernelMode, LogprobsWithGrad, RunsEngineKernels

pytestmark = pytest.mark.C8

CHEAP_CASES = [c.id for c in G.GRAD_CASES.values() if not c.expensive]
EXPENSIVE_CASES = [c.id for c in G.GRAD_CASES.values() if c.expensive]
PINNED = (GradShape(rows=257, width=512, out=48, inner=4, seed=1),   # the longest reductions drawn
          GradShape(rows=1, width=1, out=1, inner=1, seed=2))        # the degenerate ones


def _examples(expensive: bool) -> int:
    """The loaded hypothesis profile's budget (a quarter of it for expensive cases, at least 2)."""
    n = settings.default.max_examples
    return max(2, n // 4) if expensive else n


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def kernel_mode(impl):
    """Zero-argument factory of the implementation's kernel mode (every forward and backward of
    these checks runs under it); where it is not HasKernelMode, the checks' default (the
    reference batch-invariant mode, fixtures.checks.grad_checks.default_kernel_mode)."""
    return impl.kernel_mode if isinstance(impl, HasKernelMode) else G.default_kernel_mode()


@pytest.fixture(scope="session")
def trainer_mode(impl, trainer, kernel_mode):
    """The mode the trainer's own forward and backward run under in the model-level checks: the
    implementation's kernel mode; none for a trainer that is RunsEngineKernels (it calls the
    engine's kernels outside torch dispatch, which a dispatch mode cannot serve - measured on an
    H200: vLLM's custom ops under the reference mode fail with a pybind cast error), so its own
    backward is what is judged."""
    import contextlib
    if isinstance(trainer, RunsEngineKernels) and not isinstance(impl, HasKernelMode):
        return contextlib.nullcontext
    return kernel_mode


@pytest.fixture(scope="session")
def train_sequences(proxy, pytestconfig):
    """A few random id sequences of different lengths (seeded by --proxy-seed)."""
    return random_sequences(proxy.config.vocab_size, (12, 7, 16), seed=1000 + pytestconfig.getoption("--proxy-seed"))


@pytest.fixture(scope="session")
def trainer_loss(trainer):
    """loss(model, sequences) = -mean token logprob, through the trainer's own forward where it
    is LogprobsWithGrad, else fixtures.checks.grad_checks.sequence_loss over its module()."""
    if not isinstance(trainer, LogprobsWithGrad):
        return G.sequence_loss
    return lambda model, seqs: -torch.cat([lp.reshape(-1) for lp in trainer.logprobs_with_grad(seqs)]).mean()


@pytest.fixture(scope="session")
def train_calls(trainer, train_sequences, trainer_loss, kernel_mode):
    """Recorded training-forward calls: the inventory's unpadded step and the trainer's own path."""
    model = trainer.module()
    a = G.record_train_calls(model, train_sequences, kernel_mode=kernel_mode, loss_fn=G.unpadded_loss)
    b = G.record_train_calls(model, train_sequences, kernel_mode=kernel_mode, loss_fn=trainer_loss)
    return a.merge(b)


@pytest.fixture(scope="session")
def trainer_grads(trainer, train_sequences, trainer_loss, trainer_mode):
    return G.model_grads(trainer.module(), train_sequences, loss_fn=trainer_loss, kernel_mode=trainer_mode)


# ---------------------------------------------------------------------------------------------
# every op has a backward
# ---------------------------------------------------------------------------------------------
def test_every_op_has_backward(inventory, train_calls, kernel_mode, record_metric):
    """Each op reached in train-forward, replayed through autograd with the inputs that required
    grad in training, differentiates (no missing formula, no autograd-fallback node)."""
    missing = G.ops_without_backward(inventory, train_calls, kernel_mode=kernel_mode)
    unlisted = G.unlisted_ops(inventory, train_calls)
    record_metric("C8 ops replayed through autograd", len(train_calls))
    record_metric("C8 training ops outside the inventory", len(unlisted))
    assert not missing, (
        f"{len(missing)} op(s) reached in the training forward of {inventory.model} have no backward "
        "(their gradient formula is missing; register one, e.g. torch.library.register_autograd):\n  "
        + "\n  ".join(f"{op}: {why}" for op, why in missing.items()))


def test_every_reached_kernel_has_grad_check(inventory):
    """Every KERNEL-policy kernel the model reaches is exercised by a gradient-bound case."""
    uncovered = G.uncovered_kernels(inventory)
    assert not uncovered, (
        f"kernels reached by {inventory.model} with no C8 gradient case (add one to "
        f"fixtures.checks.grad_checks.GRAD_CASES): {uncovered}")


# ---------------------------------------------------------------------------------------------
# run-to-run determinism of the model's gradients and of the optimizer step
# ---------------------------------------------------------------------------------------------
def test_grads_deterministic_and_finite(trainer, train_sequences, trainer_loss, trainer_mode, record_metric):
    model = trainer.module()
    res = G.grads_deterministic(model, train_sequences, loss_fn=trainer_loss, kernel_mode=trainer_mode)
    record_metric("C8 parameters with a gradient", len(res.grads))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert res.grads, "the backward produced no parameter gradient at all"
    assert not res.without_grad, (
        f"{len(res.without_grad)} of {len(trainable)} trainable parameters got no gradient from the "
        f"-mean logprob loss (an op in their path has no backward, or the graph was cut): {res.without_grad}")


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("optimizer", sorted(G.OPTIMIZERS))
def test_optimizer_step_deterministic(trainer, trainer_grads, optimizer, foreach):
    params = {n: p.detach() for n, p in trainer.module().named_parameters() if n in trainer_grads.grads}
    G.optimizer_steps_deterministic(params, trainer_grads.grads, optimizer, foreach=foreach, steps=2)


# ---------------------------------------------------------------------------------------------
# per-op gradient bounds against float64, and the planted wrong backwards that must exceed them
# ---------------------------------------------------------------------------------------------
def _bound_examples(case_id: str, kernel_mode, record_metric) -> None:
    case = G.GRAD_CASES[case_id]
    worst = {"ratio": 0.0, "diff": 0.0}

    @settings(max_examples=_examples(case.expensive))
    @given(shape=G.grad_shapes())
    @example(shape=PINNED[0])
    @example(shape=PINNED[1])
    def run(shape):
        note(f"case {case_id}: {case.doc}")
        rep = G.assert_grad_within_bound(case, shape, kernel_mode=kernel_mode)
        worst["ratio"] = max(worst["ratio"], rep.max_ratio)
        worst["diff"] = max(worst["diff"], rep.max_abs_diff)

    run()
    record_metric(f"C8 grad max ratio {case_id}", worst["ratio"])
    record_metric(f"C8 grad max abs diff {case_id}", worst["diff"])


@pytest.mark.parametrize("case_id", CHEAP_CASES)
def test_grad_within_bound(case_id, kernel_mode, record_metric):
    _bound_examples(case_id, kernel_mode, record_metric)


@pytest.mark.parametrize("case_id", EXPENSIVE_CASES)
def test_grad_within_bound_expensive(case_id, kernel_mode, record_metric):
    _bound_examples(case_id, kernel_mode, record_metric)


@pytest.mark.parametrize("planted", sorted(G.PLANTED_BACKWARDS))
def test_planted_backward_exceeds_bound(planted, kernel_mode, record_metric):
    """Negative control: the check must report each planted wrong backward, at every drawn shape.

    A planted rounding fault shows in each output element only with some probability: one element
    can by chance round within the bound (measured: a bf16-accumulated sum of 64 rows into a
    single element stayed at ratio 0.46 for 1 seed in 20). So the drawn shapes of this control
    have at least 16 output columns, where the fault is seen every time (20 of 20 seeds, min
    ratio 127); the degenerate shape stays pinned as an example with a seed where it shows."""
    p = G.PLANTED_BACKWARDS[planted]
    least = {"ratio": float("inf")}

    @settings(max_examples=_examples(G.GRAD_CASES[p.case].expensive))
    @given(shape=G.grad_shapes(min_width=16))
    @example(shape=PINNED[0])
    @example(shape=PINNED[1])
    def run(shape):
        rep = G.check_planted(p, shape, kernel_mode=kernel_mode)
        least["ratio"] = min(least["ratio"], rep.max_ratio)
        assert not rep.ok, (
            f"planted wrong backward {p.name} ({p.doc}) stayed within the C8 bound at {shape} "
            f"(max ratio {rep.max_ratio:.3g}): the bound cannot see it - it is too loose\n{rep.message()}")

    run()
    record_metric(f"C8 planted {planted} min ratio", least["ratio"])
