"""Gate C7 - Train-inference parity: for engine rollouts (temperature 1, several samples per
prompt, different lengths), the trainer's logprobs of the sampled tokens equal the engine's
sampled-token logprobs and the engine's prompt logprobs of the full sequence; k1, k3, max abs
diff and mismatch fraction are all exactly 0. Trainer and engine use the same TP degree, and a
trainer that can compute at another one must be seen to differ there.

The rollout is sized by lane (fixtures.checks.workloads.parity_workload): on a GPU a rollout
batch of hundreds of sequences, so engine steps and trainer micro-batches pass 256 and 1024
tokens (a kernel that switches there is invisible at a toy batch); the trainer packs the
sequences into micro-batches of --trainer-micro-batch-tokens. The controls keep the toy batch."""
from __future__ import annotations

import pytest

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import (ComputesAtTensorParallel, HasTensorParallel, Layout, NamesSampler, PlantsULP,
                                    RecordsModuleOutputs, supported_layouts)
from fixtures.core.full_rows import ReturnsFullVocabLogprobs
from fixtures.core.outcomes import must_fire, not_applicable, not_available
from fixtures.diagnose.module_outputs import compare_module_outputs
from fixtures.checks.controls import stock_trainer
from fixtures.checks.rollouts import assert_full_rows, assert_parity, sample_rollouts
from fixtures.checks.workloads import PARITY_CPU, parity_workload, random_ids, rollout_requests
from fixtures.plugin.options import trainer_micro_batch_tokens

pytestmark = pytest.mark.C7


@pytest.fixture(scope="module")
def workload(impl):
    return parity_workload(impl.device())


@pytest.fixture(scope="module")
def micro_batch_tokens(pytestconfig, workload) -> int:
    """The trainer's micro-batch bound: --trainer-micro-batch-tokens, else the lane's default."""
    return trainer_micro_batch_tokens(pytestconfig) or workload.micro_batch_tokens


@pytest.fixture(scope="module")
def rollouts(engine, proxy, workload):
    """The lane's parity rollout (hundreds of sequences on a GPU), with the engine's step sizes."""
    return sample_rollouts(engine, workload.requests(proxy.config.vocab_size, seed=1))


@pytest.fixture(scope="module")
def toy_rollouts(request, engine, proxy, workload):
    """4 prompts x 2 samples: enough for a control, which only has to show a difference."""
    if workload == PARITY_CPU:
        return request.getfixturevalue("rollouts")
    return sample_rollouts(engine, PARITY_CPU.requests(proxy.config.vocab_size, seed=1))


def _tp(obj) -> int:
    """The tensor-parallel degree an engine or trainer computes at (not HasTensorParallel: 1)."""
    return obj.tensor_parallel_size if isinstance(obj, HasTensorParallel) else 1


def test_same_tensor_parallel_degree(engine, trainer):
    """A different TP degree splits reductions differently and can never match (the control
    below shows it does not)."""
    e, t = _tp(engine), _tp(trainer)
    assert e == t, f"engine TP={e} vs trainer TP={t}: parity needs the same tensor-parallel degree"


def test_control_other_tensor_parallel_degree_breaks_parity(engine, trainer, toy_rollouts):
    """Negative control for the TP claim, both ways: the same trainer computing as vLLM at another
    TP degree (TP=2 against a TP=1 engine, TP=1 against a TP>1 one) must report a difference -
    else the trainer's TP arithmetic is not what decides parity."""
    if not isinstance(trainer, ComputesAtTensorParallel):
        not_applicable("the trainer is not ComputesAtTensorParallel (it cannot compute at another tensor-parallel "
                       "degree)", capability=ComputesAtTensorParallel)
    e = _tp(engine)
    other = 1 if e > 1 else 2
    try:
        with must_fire(f"the trainer at TP={other} arithmetic matched the TP={e} engine bit for bit",
                       tried=f"trainer at TP={other} vs engine at TP={e}", catch=(BitwiseMismatch, AssertionError),
                       on_this_hardware=False):
            with trainer.at_tensor_parallel(other):
                assert_parity(engine, trainer, toy_rollouts)
    except NotImplementedError as exc:
        not_available(exc, f"the trainer at TP={other}", capability=ComputesAtTensorParallel)


def test_trainer_reads_logprobs_as_the_engine_samples(engine, trainer):
    """vLLM 0.26's two model runners report a logprob through different kernels (V2: a Triton
    top-k log-softmax; V1: log_softmax in float32): a trainer copying the engine's arithmetic must
    copy the one this engine runs."""
    lacking = [who for who, obj in (("engine", engine), ("trainer", trainer)) if not isinstance(obj, NamesSampler)]
    if lacking:
        not_applicable(f"the {' and the '.join(lacking)} {'is' if len(lacking) == 1 else 'are'} not NamesSampler "
                       "(names no sampler)", capability=NamesSampler)
    theirs, mine = engine.sampler, trainer.sampler
    assert mine == theirs, f"trainer computes logprobs like vLLM's {mine} runner; the engine runs {theirs}"


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda l: l.value)
def test_trainer_equals_engine(request, engine, trainer, layout, micro_batch_tokens, record_metric):
    """The lane's rollout, the trainer in micro-batches of <= micro_batch_tokens tokens; the
    message and the metrics say how many tokens, and which step and micro-batch sizes, were compared.
    The rollout is asked for after the layout check: an n/a layout on a worker of its own took 113 s
    of the H200 to sample a rollout it then skipped (qwen3_moe, 2026-12-02)."""
    if layout not in supported_layouts(trainer):
        not_applicable(f"the trainer has no {layout.value} layout for this architecture", feature=f"layout {layout.value}")
    rollouts = request.getfixturevalue("rollouts")
    assert len({len(r.token_ids) for r in rollouts}) > 1, "rollouts must finish at different lengths"
    assert_parity(engine, trainer, rollouts, layout=layout, record=record_metric, micro_batch_tokens=micro_batch_tokens)


def test_greedy_and_low_temperature_rollouts(engine, trainer, proxy, micro_batch_tokens, record_metric):
    for temperature in (0.0, 0.6):
        rs = sample_rollouts(engine, rollout_requests(proxy.config.vocab_size, 3, seed=2, n=1, temperature=temperature))
        assert_parity(engine, trainer, rs, record=record_metric if temperature else None,
                      micro_batch_tokens=micro_batch_tokens)


def _full_rows(engine, trainer, rollouts, **kw) -> int:
    lacking = [who for who, obj in (("engine", engine), ("trainer", trainer))
               if not isinstance(obj, ReturnsFullVocabLogprobs)]
    if lacking:
        not_applicable(f"the {' and the '.join(lacking)} {'is' if len(lacking) == 1 else 'are'} not "
                       "ReturnsFullVocabLogprobs (no whole-vocabulary rows)", capability=ReturnsFullVocabLogprobs)
    try:
        return assert_full_rows(engine, trainer, rollouts, **kw)
    except NotImplementedError as exc:
        not_available(exc, "full-vocabulary logprob rows", capability=ReturnsFullVocabLogprobs)


def test_full_vocabulary_rows_equal_engine(engine, trainer, rollouts, record_metric):
    """The whole distribution, not one token: a sampled-token logprob that matches can hide a
    different distribution (a KL or entropy term over the vocabulary sees it). At seeded positions
    of every rollout's generated part (2 each at the lane's toy batch, 1 - its last - at rollout
    scale: a row is the whole vocabulary), the trainer's row equals the engine's bit for bit."""
    _full_rows(engine, trainer, rollouts, per_rollout=2 if len(rollouts) <= 16 else 1, seed=3, record=record_metric)


class _OneEntryOff:
    """A trainer whose full rows have one entry - of a token that does not follow there - moved
    one ULP: the full-row check must see it (its sampled-token logprobs are the trainer's own)."""

    def __init__(self, inner):
        self.inner = inner

    def full_logprobs(self, sequences, positions):
        import torch
        rows = [r.clone() for r in self.inner.full_logprobs(sequences, positions)]
        k = next(i for i, ps in enumerate(positions) if ps)
        v = 1 if sequences[k][positions[k][0] + 1] == 0 else 0
        rows[k][0, v] = torch.nextafter(rows[k][0, v], torch.tensor(float("-inf")))
        return rows


def test_control_full_rows_see_an_entry_off_the_sampled_token(engine, trainer, toy_rollouts):
    """Negative control for the full-row check: one entry one ULP off, away from the token that
    follows (so no sampled-token or prompt logprob could show it), must be reported."""
    with must_fire("an entry one ULP off in one row went unseen by the full-row check",
                   tried="the C7 toy rollouts' full rows, one entry of one row moved by one ULP",
                   catch=(BitwiseMismatch, AssertionError), on_this_hardware=False):
        _full_rows(engine, _OneEntryOff(trainer) if isinstance(trainer, ReturnsFullVocabLogprobs) else trainer,
                   toy_rollouts, per_rollout=2, seed=3)


def _module_probe(proxy) -> list[int]:
    return list(random_ids(proxy.config.vocab_size, 37, seed=7))


def _module_recorders(engine, trainer):
    lacking = [who for who, obj in (("engine", engine), ("trainer", trainer))
               if not isinstance(obj, RecordsModuleOutputs)]
    if lacking:
        not_applicable(f"the {' and the '.join(lacking)} {'is' if len(lacking) == 1 else 'are'} not "
                       "RecordsModuleOutputs (module-by-module parity needs both to record their module outputs under "
                       "one naming: vLLM + the engine-kernel trainer)", capability=RecordsModuleOutputs)


def test_every_module_output_equals_engine(engine, trainer, proxy, record_metric):
    """One prefill, every module output: the engine's (forward hooks in its worker) vs the
    trainer's at the same point. Equal final logprobs with a differing intermediate would be luck;
    a differing point is named, with everything upstream of it equal."""
    _module_recorders(engine, trainer)
    seq = _module_probe(proxy)
    try:
        theirs = engine.module_outputs(seq)
    except NotImplementedError as exc:          # e.g. TP > 1: the modules live in vLLM's worker processes
        not_available(exc, "the engine's module outputs", capability=RecordsModuleOutputs)
    result = compare_module_outputs(theirs, trainer.module_outputs(seq, naming=engine.module_naming))
    record_metric("module_points_compared", len(result.compared))
    record_metric("module_points_differing", len(result.differing_points))
    assert result.compared, result.describe()
    assert result.equal, "engine vs trainer module outputs (bitwise):\n" + result.describe()


def test_control_planted_ulp_is_named(trainer, proxy):
    """Negative control for the comparison above: the trainer against itself with one op's
    output moved by one ULP must name exactly that op's module, with everything upstream equal."""
    for capability in (RecordsModuleOutputs, PlantsULP):
        if not isinstance(trainer, capability):
            not_applicable(f"the trainer is not {capability.__name__}", capability=capability)
    import contextlib
    seq = _module_probe(proxy)
    whole = trainer.at_tensor_parallel(1) if isinstance(trainer, ComputesAtTensorParallel) else contextlib.nullcontext()
    with whole:                 # every point recorded whole (a TP>1 trainer records only the all-reduced ones)
        clean = dict(trainer.module_outputs(seq))
        with trainer.planted_ulp() as expected:
            planted = trainer.module_outputs(seq)
    assert expected in clean, f"the planted op's point {expected} is not among the recorded points {list(clean)[:8]}"
    result = compare_module_outputs(list(clean.items()), planted, names=("trainer", "planted trainer"))
    assert result.first == expected, result.describe()
    assert "1 of" in result.detail and "1 ULP apart" in result.detail, result.detail


def test_control_stock_trainer_breaks_parity(engine, proxy, impl, toy_rollouts):
    """Negative control: the same parity check with a trainer on stock kernels and eager
    attention (the implementation's dtype and device) must report a difference."""
    with stock_trainer(proxy.path, impl) as stock, \
            must_fire("a stock trainer matched the invariant engine bit for bit", catch=(BitwiseMismatch, AssertionError),
                      tried=f"the C7 rollouts through a stock trainer (eager attention, "
                            f"{str(impl.dtype()).replace('torch.', '')} on {impl.device()})"):
        assert_parity(engine, stock, toy_rollouts)
