"""Gate C9 - Two-step RL acceptance: rollout (seeded, temperature 1) -> trainer logprobs (KL
exactly 0) -> policy-gradient loss on a simple verifiable reward -> optimizer step -> weights
pushed to the engine through its public update path -> engine weights equal the trainer's
(per-tensor hash under canonical checkpoint names) -> second rollout -> KL exactly 0 again;
parameters did change. Skipping the weight push must be detected.

Each rollout is the lane's parity rollout (fixtures.checks.workloads.parity_workload: hundreds of
sequences on a GPU, engine steps and trainer micro-batches past 256 and 1024 tokens), the trainer
packing it into micro-batches of --trainer-micro-batch-tokens for both its logprobs and its
optimizer steps (one per micro-batch, as PPO mini-batches; one on the CPU lane's toy rollout).

The second rollout re-sends the first one's prompts (new sampling seeds), as RL does across GRPO
groups and epochs, with the prefix cache as the push left it: it must equal the same requests from
a cold cache (and the trainer), so a cache that survived the push, serving K/V of the old weights,
is caught; the first rollout's prompts must be seen held in the cache at the push."""
from __future__ import annotations

import pytest
import torch

from fixtures.runtime import costs
from fixtures.core.comparison import BitwiseMismatch, expecting_mismatch
from fixtures.core.contract import ResetsPrefixCache, TrainsRL
from fixtures.core.outcomes import not_applicable, not_available, not_carried_out
from fixtures.diagnose.engine_rows import run_stated
from fixtures.checks.rollouts import assert_parity, collect, sample_rollouts
from fixtures.checks.weight_push import assert_served_fresh, held_prompts, resent
from fixtures.checks.workloads import pack_micro_batches, parity_workload
from fixtures.plugin.options import trainer_micro_batch_tokens

pytestmark = pytest.mark.C9


def reward(tokens: list[int]) -> float:
    """Verifiable toy reward: the fraction of generated ids that are even."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


@pytest.fixture
def parity(impl, pytestconfig):
    """(workload, micro-batch tokens) of this lane: --trainer-micro-batch-tokens, else the lane's."""
    workload = parity_workload(impl.device())
    return workload, trainer_micro_batch_tokens(pytestconfig) or workload.micro_batch_tokens


@pytest.fixture
def phases():
    """Where a C9 check's minutes go (set-up, rollouts, parity, optimizer steps, hashes, push): one
    "C9 phases" cost with its parts, in the report's time section."""
    timer = costs.Phases("C9 phases")
    yield timer
    timer.record()


def rl_step(engine, trainer, vocab: int, seed: int, parity, phases, record=None, label="", rollouts=None):
    """Rollout (or the given `rollouts`), parity with the trainer, one optimizer step per micro-batch."""
    workload, mbt = parity
    rs = rollouts
    if rs is None:
        with phases("rollouts"):
            rs = sample_rollouts(engine, workload.requests(vocab, seed=seed))
    with phases("parity (trainer logprobs)"):
        metrics = assert_parity(engine, trainer, rs, record=record, label=label, micro_batch_tokens=mbt)
    rewards = torch.tensor([reward(r.token_ids) for r in rs], dtype=torch.float64)
    adv = (rewards - rewards.mean()).tolist()
    if not any(adv):
        adv = [1.0 if i % 2 else -1.0 for i in range(len(rs))]   # keep the step non-trivial
    info = {}
    with phases("optimizer steps"):
        for mb in pack_micro_batches([len(r.sequence) for r in rs], mbt):
            info = trainer.train_step([rs[k].sequence for k in mb], prompt_lens=[len(rs[k].prompt_ids) for k in mb],
                                      advantages=[adv[k] for k in mb])
    return metrics, info


def _lossy(dtype: torch.dtype) -> torch.dtype:
    """A narrower float format for the lossy-push control: bf16 for fp32 weights; for bf16 / fp16
    weights (the GPU lane) an 8-bit float, since a bf16 round trip of bf16 weights changes nothing."""
    return torch.bfloat16 if dtype == torch.float32 else torch.float8_e4m3fn


def mismatched_hashes(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def both_hashes(engine, trainer) -> tuple[dict, dict]:
    """(the engine's, the trainer's) weight hashes, the engine's asked from a thread so that an
    engine in a process of its own hashes while the trainer hashes here. Why: on the H200 a C9
    check spent 12.4 s in its hash phases, the sides one after the other (3.3 GB of bf16 weights a
    side for qwen3's shallow proxy)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="c9-engine-hashes") as pool:
        theirs = pool.submit(engine.weight_hashes)
        mine = trainer.weight_hashes()
        return theirs.result(), mine


@pytest.fixture
def fresh_pair(impl, proxy, engine_factory, phases):
    """A trainer and an engine of their own: C9 changes weights, the session ones stay untouched.
    The engine comes from `engine_factory` (its n/a, its output shape check), not from the
    implementation directly."""
    try:
        with phases("trainer set-up"):
            trainer = impl.make_trainer(proxy.path)
    except NotImplementedError as exc:      # a trainer that does not cover the model: n/a, never red
        not_available(exc, "no trainer")
    if not isinstance(trainer, TrainsRL):
        trainer.close()
        not_applicable("the trainer is not TrainsRL (no train_step / weight_hashes / export_weights: no RL step "
                       "to take)", capability=TrainsRL)
    try:
        with phases("engine set-up"):
            engine = engine_factory()
    except BaseException:                   # no engine (n/a) or its start failed: the trainer goes too
        trainer.close()
        raise
    if not engine.capabilities().weight_update:
        not_applicable("the engine has no weight update path", feature="weight_update")
    yield engine, trainer
    with phases("closing"):
        engine.close()
        trainer.close()


@pytest.mark.slow(seconds=100)
def test_two_rl_steps_stay_exactly_on_policy(fresh_pair, proxy, parity, phases, record_metric):
    engine, trainer = fresh_pair
    vocab = proxy.config.vocab_size
    with phases("weight hashes"):
        engine_before, before = both_hashes(engine, trainer)
        start_bad = mismatched_hashes(engine_before, before)
    assert start_bad == [], "engine and trainer start from different weights"
    step1 = parity[0].requests(vocab, seed=10)
    rl_step(engine, trainer, vocab, seed=10, parity=parity, phases=phases, record=record_metric, label="step1_")
    with phases("rollouts"):
        prompts_held(engine, step1, record_metric)
    with phases("weight hashes"):
        after = trainer.weight_hashes()
    changed = mismatched_hashes(before, after)
    assert changed, "the optimizer step changed no parameter"
    with phases("weight push"):
        engine.load_weights(trainer.export_weights())
    with phases("weight hashes"):
        bad = mismatched_hashes(engine.weight_hashes(), after)
    assert not bad, f"after the weight push {len(bad)} tensors differ between engine and trainer: {bad[:5]}"
    record_metric("tensors_changed", len(changed))
    with phases("rollouts"):
        rs = resend_after_push(engine, step1, record_metric)
    rl_step(engine, trainer, vocab, seed=11, parity=parity, phases=phases, record=record_metric, label="step2_",
            rollouts=rs)


STEP2_STATE = ("warm from step 1 (its prompts ran on the old weights, then the weight push; the prefix cache as the "
               "push left it)")


def prompts_held(engine, step1, record) -> None:
    """Before the push: step 1's prompts, re-sent for one token, read the prefix cache - so a cache
    that survives the push would serve them to step 2 (else the repeat proves nothing). An engine
    without a prefix cache has none to go stale: nothing to see, no metric."""
    if not engine.capabilities().prefix_cache:
        return
    probes = held_prompts(step1)
    held = sum(c.num_cached_tokens for c in engine.generate(probes))
    record("step1_prompt_tokens_held_at_push", held)
    if held == 0:      # the cache kept nothing to go stale: the re-send would prove nothing (#44)
        not_carried_out(f"the declared prefix cache held none of step 1's {len(probes)} prompts "
                        f"({sum(len(r.prompt_ids) for r in probes)} tokens) at the weight push: nothing a stale "
                        "cache could serve step 2 (a KV cache too small to keep them is the usual cause)")


def resend_after_push(engine, step1, record):
    """Step 2's rollout: step 1's prompts again on the cache as the push left it, checked against
    the same requests from a cold cache (ResetsPrefixCache) before the trainer sees it."""
    requests = resent(step1)
    warm, _ = run_stated(engine, requests, requests[0].request_id, label="step 2", state=STEP2_STATE)
    stats = engine.last_stats()
    record("step2_cached_prompt_tokens", int(stats.cached_prompt_tokens))
    if isinstance(engine, ResetsPrefixCache):
        cold, cold_run = run_stated(engine, requests, requests[0].request_id, label="cold start")
        assert_served_fresh(warm, cold, after_traces=dict(stats.requests or {}),
                            cold_traces=dict(engine.last_stats().requests or {}), after_label="step 2 after the push",
                            after_state=STEP2_STATE, cold_state=cold_run.state, nothing_computed_since=False)
    return collect(warm, stats)


@pytest.mark.slow(seconds=60)
def test_skipped_and_lossy_pushes_are_detected(fresh_pair, proxy, parity, phases):
    """Negative controls, on one engine and trainer after one RL step (one rollout-scale step
    serves both: the second cost 30-50 s on the H200):
    - skipped push: the engine is off-policy; the per-tensor hashes and the second rollout's parity
      must both say so (the parity failure is expected: it is not diagnosed or localised);
    - lossy push: weights synced through a narrower float (bf16 for fp32 weights, fp8 for bf16
      ones), a rounding the trainer never holds; the hashes must see it.
    Each control is judged; a control that did not fire is named."""
    engine, trainer = fresh_pair
    vocab = proxy.config.vocab_size
    rl_step(engine, trainer, vocab, seed=10, parity=parity, phases=phases)
    silent = []
    with phases("weight hashes"):
        if not mismatched_hashes(*both_hashes(engine, trainer)):
            silent.append("skipped push not detected by the per-tensor hashes")
    workload, mbt = parity
    with phases("rollouts"):
        rs = sample_rollouts(engine, workload.requests(vocab, seed=11))
    try:
        with expecting_mismatch(), phases("parity (trainer logprobs)"):
            assert_parity(engine, trainer, rs, micro_batch_tokens=mbt)
        silent.append(f"skipped push not detected by the parity of the second rollout ({len(rs)} sequences): the "
                      "stale engine matched the stepped trainer bit for bit")
    except (BitwiseMismatch, AssertionError):
        pass
    with phases("weight push"):
        engine.load_weights({k: v.to(_lossy(v.dtype)).to(v.dtype) for k, v in trainer.export_weights().items()})
    with phases("weight hashes"):
        if not mismatched_hashes(*both_hashes(engine, trainer)):
            silent.append("a lossy round trip of the weights went unnoticed by the hashes")
    assert not silent, "C9 negative controls did not fire:\n  " + "\n  ".join(silent)
