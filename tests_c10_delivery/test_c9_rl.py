"""Gate C9 - Two-step RL acceptance: rollout (seeded, temperature 1) -> trainer logprobs (KL
exactly 0) -> policy-gradient loss on a simple verifiable reward -> optimizer step -> weights
pushed to the engine through its public update path -> engine weights equal the trainer's
(per-tensor hash under canonical checkpoint names) -> second rollout -> KL exactly 0 again;
parameters did change. Skipping the weight push must be detected."""
from __future__ import annotations

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import TrainsRL
from fixtures.core.outcomes import not_applicable, not_available
from fixtures.checks.rollouts import assert_parity, collect
from fixtures.checks.workloads import rollout_requests

pytestmark = pytest.mark.C9


def reward(tokens: list[int]) -> float:
    """Verifiable toy reward: the fraction of generated ids that are even."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def rl_step(engine, trainer, vocab: int, seed: int, record=None, label=""):
    rs = collect(engine.generate(rollout_requests(vocab, 4, seed=seed, n=2)))
    metrics = assert_parity(engine, trainer, rs, record=record, label=label)
    rewards = torch.tensor([reward(r.token_ids) for r in rs], dtype=torch.float64)
    adv = (rewards - rewards.mean()).tolist()
    if not any(adv):
        adv = [1.0 if i % 2 else -1.0 for i in range(len(rs))]   # keep the step non-trivial
    info = trainer.train_step([r.sequence for r in rs], prompt_lens=[len(r.prompt_ids) for r in rs], advantages=adv)
    return metrics, info


def _lossy(dtype: torch.dtype) -> torch.dtype:
    """A narrower float format for the lossy-push control: bf16 for fp32 weights; for bf16 / fp16
    weights (the GPU lane) an 8-bit float, since a bf16 round trip of bf16 weights changes nothing."""
    return torch.bfloat16 if dtype == torch.float32 else torch.float8_e4m3fn


def mismatched_hashes(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@pytest.fixture
def fresh_pair(impl, proxy):
    """A trainer and an engine of their own: C9 changes weights, the session ones stay untouched."""
    trainer = impl.make_trainer(proxy.path)
    if not isinstance(trainer, TrainsRL):
        trainer.close()
        not_applicable("the trainer is not TrainsRL (no train_step / weight_hashes / export_weights: no RL step "
                       "to take)", capability=TrainsRL)
    try:
        engine = impl.make_engine(proxy.path)
    except NotImplementedError as exc:
        trainer.close()
        not_available(exc, "no engine")
    if not engine.capabilities().weight_update:
        not_applicable("the engine has no weight update path", feature="weight_update")
    yield engine, trainer
    engine.close()
    trainer.close()


def test_two_rl_steps_stay_exactly_on_policy(fresh_pair, proxy, record_metric):
    engine, trainer = fresh_pair
    vocab = proxy.config.vocab_size
    before = trainer.weight_hashes()
    assert mismatched_hashes(engine.weight_hashes(), before) == [], "engine and trainer start from different weights"
    rl_step(engine, trainer, vocab, seed=10, record=record_metric, label="step1_")
    after = trainer.weight_hashes()
    changed = mismatched_hashes(before, after)
    assert changed, "the optimizer step changed no parameter"
    engine.load_weights(trainer.export_weights())
    bad = mismatched_hashes(engine.weight_hashes(), after)
    assert not bad, f"after the weight push {len(bad)} tensors differ between engine and trainer: {bad[:5]}"
    record_metric("tensors_changed", len(changed))
    rl_step(engine, trainer, vocab, seed=11, record=record_metric, label="step2_")


def test_skipped_push_is_detected(fresh_pair, proxy):
    """Negative control: without the weight push the engine is off-policy; hashes and the second
    rollout's parity must both say so."""
    engine, trainer = fresh_pair
    rl_step(engine, trainer, proxy.config.vocab_size, seed=10)
    assert mismatched_hashes(engine.weight_hashes(), trainer.weight_hashes()), \
        "skipped push not detected by the per-tensor hashes"
    rs = collect(engine.generate(rollout_requests(proxy.config.vocab_size, 4, seed=11, n=2)))
    with pytest.raises((BitwiseMismatch, AssertionError)):
        assert_parity(engine, trainer, rs)


def test_push_through_another_dtype_is_detected(fresh_pair, proxy):
    """Negative control: weights synced through a narrower float (bf16 for fp32 weights, fp8 for
    bf16 ones): a rounding the trainer never holds."""
    engine, trainer = fresh_pair
    rl_step(engine, trainer, proxy.config.vocab_size, seed=10)
    engine.load_weights({k: v.to(_lossy(v.dtype)).to(v.dtype) for k, v in trainer.export_weights().items()})
    assert mismatched_hashes(engine.weight_hashes(), trainer.weight_hashes()), \
        "a lossy round trip of the weights went unnoticed by the hashes"
