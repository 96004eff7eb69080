"""Gate C3 - Engine batch invariance: a needle request alone equals the same request at random
positions among N random requests; batch of 1 equals batch of N; the same batch twice gives the
same bits; greedy and seeded sampling alike; token ids and sampled-token logprobs compared.

Every run starts cold (the prefix cache reset first), so C3 varies the batch and nothing else: a
prefix-cache hit is C4's to judge. A failure states, for both sides, how the compared request ran
(cached prompt tokens, the tokens of each step it was in); the localisation reruns both sides from
the same state, finds the request's rows by request (a prompt repeated in the batch included) and
says whether the reruns reproduced the failing runs' state."""
from __future__ import annotations

import pytest
from hypothesis import given, note, strategies as st

from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.core.outcomes import must_fire
from fixtures.diagnose.engine_rows import COLD, StatedRun, localise_in_engine, run_stated, state_context
from fixtures.checks.workloads import (assert_same_completion, engine_settings, fixed_batch, max_batch,
                                       needle_batch, requests)

pytestmark = pytest.mark.C3


def compare_needle(engine, needle: Request, batch: list[Request], pos: int, *, more_than: int = 1) -> None:
    """`needle` alone vs at `pos` of `batch`, both runs cold; the batch must really have run more
    than `more_than` requests together."""
    __tracebackhide__ = True
    (alone_c,), alone = run_stated(engine, [needle], needle.request_id, label="alone")
    inside_c, inside = run_stated(engine, batch, needle.request_id, label=f"at {pos} in a batch of {len(batch)}")
    stats = engine.last_stats()
    assert stats.max_running > more_than or len(batch) <= more_than, \
        f"the batch never ran more than {more_than} requests together: {stats}"
    assert_same_completion(alone_c, inside_c[pos], lhs=alone.label, rhs=inside.label, batch_size=len(batch),
                           needle_position=pos, **state_context(alone, inside),
                           localise=lambda: localise_in_engine(engine, needle, batch, pos, sides=(alone, inside)))


@engine_settings()
@given(data=st.data())
def test_needle_alone_equals_needle_in_batch(engine, proxy, data):
    """Each example, and its replay, from a cold prefix cache: otherwise a replay finds the
    batch's prompts cached, computes fewer tokens per step and can pass where the first run
    failed (measured at full depth: a kernel switching at 256 tokens per step)."""
    needle, others, pos = data.draw(needle_batch(proxy.config.vocab_size, max_batch()))
    batch = others[:pos] + [needle] + others[pos:]
    copies = sum(r.prompt_ids == needle.prompt_ids for r in batch)
    note(f"needle at {pos} among {len(others)}; needle prompt {len(needle.prompt_ids)} tokens ({copies} in the "
         f"batch), {needle.params}")
    compare_needle(engine, needle, batch, pos)


@engine_settings(divisor=8, floor=1)
@given(reqs=st.data())
def test_every_request_alone_equals_batch(engine, proxy, reqs):
    batch = reqs.draw(requests(proxy.config.vocab_size, 7))
    together, run = run_stated(engine, batch, batch[0].request_id, label="in the batch of 7")
    traces = dict(engine.last_stats().requests or {})
    for i, r in enumerate(batch):
        inside = StatedRun(run.label, run.state, traces.get(r.request_id))
        (alone_c,), alone = run_stated(engine, [r], r.request_id, label="batch of 1")
        assert_same_completion(alone_c, together[i], lhs=alone.label, rhs=inside.label, **state_context(alone, inside),
                               localise=lambda: localise_in_engine(engine, r, batch, i, sides=(alone, inside)))


@pytest.mark.parametrize("others, position", [(11, 9), (44, 40)], ids=["needle-9-of-12", "needle-40-of-45"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_needle_past_batch_thresholds(engine, proxy, others, position, greedy):
    """Pinned cases beyond the thresholds where real engines were seen to switch (more than 8
    co-resident requests; about 44 sequences sharing a sampler batch), needle late in the batch."""
    batch = fixed_batch(proxy.config.vocab_size, others + 1, seed=others)
    needle = Request("needle", batch[position].prompt_ids,
                     SamplingParams(max_tokens=6, temperature=0.0 if greedy else 1.0, seed=77))
    batch[position] = needle
    compare_needle(engine, needle, batch, position, more_than=8)


def test_needle_among_copies_of_its_prompt(engine, proxy):
    """The needle's prompt three times in one step (two other requests carry it too): the
    comparison and its localisation tell the needle's rows from its copies' by request."""
    batch = fixed_batch(proxy.config.vocab_size, 9, seed=5)
    prompt = batch[0].prompt_ids
    needle = Request("needle", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=3))
    batch[2] = Request("copy-a", prompt, batch[2].params)
    batch[6] = Request("copy-b", prompt, batch[6].params)
    batch[4] = needle
    compare_needle(engine, needle, batch, 4)


def test_same_batch_twice(engine, proxy):
    batch = fixed_batch(proxy.config.vocab_size, 9)
    first, one = run_stated(engine, batch, batch[0].request_id, label="run 1")
    traces_one = dict(engine.last_stats().requests or {})
    second, _ = run_stated(engine, batch, batch[0].request_id, label="run 2")
    traces_two = dict(engine.last_stats().requests or {})
    for r, x, y in zip(batch, first, second):
        sides = (StatedRun("run 1", one.state, traces_one.get(r.request_id)),
                 StatedRun("run 2", one.state, traces_two.get(r.request_id)))
        assert_same_completion(x, y, lhs="run 1", rhs="run 2", **state_context(*sides))


@pytest.mark.engine_config("stock")
def test_control_stock_kernels_are_seen(engine_factory, proxy):
    """Negative control: the same needle check on the engine with stock kernels must see a
    difference (CPU fp32 GEMM is batch-variant from a few rows); where it does not, the check is
    inconclusive on this hardware - reported, never a silent pass. Every request of the batch is
    compared, as test_every_request_alone_equals_batch does: a stock GEMM's one-ULP difference
    reaches a sampled logprob's bits only now and then (measured: 2-7 of 16 requests on the tiny
    proxies; the first 4 alone saw none for qwen2_moe on the planted CPU)."""
    batch = fixed_batch(proxy.config.vocab_size, 16, seed=3)
    with engine_factory(EngineSettings(batch_invariant=False)) as stock:
        alone = [run_stated(stock, [r], r.request_id, label="alone", state=COLD)[0][0] for r in batch]
        together = run_stated(stock, batch, batch[0].request_id, label="in a batch of 16")[0]
    with must_fire("stock kernels gave identical bits alone and in a batch of 16",
                   tried="16 requests alone vs in a batch of 16, stock kernels, every run cold"):
        for a, b in zip(alone, together):
            assert_same_completion(a, b, lhs="alone", rhs="in a batch of 16")
