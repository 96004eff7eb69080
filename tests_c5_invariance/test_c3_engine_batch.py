"""Gate C3 - Engine batch invariance: a needle request alone equals the same request at random
positions among N random requests; batch of 1 equals batch of N; the same batch twice gives the
same bits; greedy and seeded sampling alike; token ids and sampled-token logprobs compared."""
from __future__ import annotations

import pytest
from hypothesis import given, note, strategies as st

from fixtures.core.contract import EngineSettings, Request, ResetsPrefixCache, SamplingParams
from fixtures.core.outcomes import must_fire
from fixtures.diagnose.engine_rows import localise_in_engine
from fixtures.checks.workloads import (assert_same_completion, assert_same_completions, engine_settings, fixed_batch,
                                       max_batch, needle_batch, requests)

pytestmark = pytest.mark.C3

@engine_settings()
@given(data=st.data())
def test_needle_alone_equals_needle_in_batch(engine, proxy, data):
    needle, others, pos = data.draw(needle_batch(proxy.config.vocab_size, max_batch()))
    batch = others[:pos] + [needle] + others[pos:]
    note(f"needle at {pos} among {len(others)}; needle prompt {len(needle.prompt_ids)} tokens, {needle.params}")
    _cold(engine)
    alone = engine.generate([needle])[0]
    inside = engine.generate(batch)[pos]
    assert engine.last_stats().max_running > 1 or len(batch) == 1, "the batch never ran requests together"
    assert_same_completion(alone, inside, lhs="alone", rhs=f"at {pos} in a batch of {len(batch)}",
                           batch_size=len(batch), needle_position=pos,
                           localise=lambda: localise_in_engine(engine, needle, batch, pos))


def _cold(engine) -> None:
    """Each hypothesis example (and its replay) from an empty prefix cache: otherwise a replay
    finds the batch's prompts cached, computes fewer tokens per step and can pass where the first
    run failed (measured at full depth: a kernel switching at 256 tokens per step)."""
    if isinstance(engine, ResetsPrefixCache):
        engine.reset_prefix_cache()


@engine_settings(divisor=8, floor=1)
@given(reqs=st.data())
def test_every_request_alone_equals_batch(engine, proxy, reqs):
    batch = reqs.draw(requests(proxy.config.vocab_size, 7))
    together = engine.generate(batch)
    for r, c in zip(batch, together):
        assert_same_completion(engine.generate([r])[0], c, lhs="batch of 1", rhs="batch of 7")


@pytest.mark.parametrize("others, position", [(11, 9), (44, 40)], ids=["needle-9-of-12", "needle-40-of-45"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_needle_past_batch_thresholds(engine, proxy, others, position, greedy):
    """Pinned cases beyond the thresholds where real engines were seen to switch (more than 8
    co-resident requests; about 44 sequences sharing a sampler batch), needle late in the batch."""
    batch = fixed_batch(proxy.config.vocab_size, others + 1, seed=others)
    needle = Request("needle", batch[position].prompt_ids,
                     SamplingParams(max_tokens=6, temperature=0.0 if greedy else 1.0, seed=77))
    batch[position] = needle
    alone = engine.generate([needle])[0]
    inside = engine.generate(batch)[position]
    assert engine.last_stats().max_running > 8, f"the batch never had more than 8 requests together: {engine.last_stats()}"
    assert_same_completion(alone, inside, lhs="alone", rhs=f"at {position} in a batch of {len(batch)}",
                           batch_size=len(batch), needle_position=position,
                           localise=lambda: localise_in_engine(engine, needle, batch, position))


def test_same_batch_twice(engine, proxy):
    batch = fixed_batch(proxy.config.vocab_size, 9)
    first, second = engine.generate(batch), engine.generate(batch)
    assert_same_completions(first, second, lhs="run 1", rhs="run 2")


def test_control_stock_kernels_are_seen(engine_factory, proxy):
    """Negative control: the same needle check on the engine with stock kernels must see a
    difference (CPU fp32 GEMM is batch-variant from a few rows); where it does not, the check is
    inconclusive on this hardware - reported, never a silent pass."""
    batch = fixed_batch(proxy.config.vocab_size, 16, seed=3)
    with engine_factory(EngineSettings(batch_invariant=False)) as stock:
        alone = [stock.generate([r])[0] for r in batch[:4]]
        together = stock.generate(batch)[:4]
    with must_fire("stock kernels gave identical bits alone and in a batch of 16",
                   tried="4 requests alone vs in a batch of 16, stock kernels"):
        for a, b in zip(alone, together):
            assert_same_completion(a, b, lhs="alone", rhs="in a batch of 16")
