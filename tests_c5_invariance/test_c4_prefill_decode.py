"""Gate C4 - Prefill/decode invariance: every decode logprob equals the prompt logprob at that
position from one prefill of prompt + generated ids (ids, never re-tokenised text); chunked
prefill at several split points equals unchunked; a prefix-cache hit equals a cold start; decode
resumed after preemption equals uninterrupted decode. Each mechanism must be seen to engage."""
from __future__ import annotations

import pytest
from hypothesis import given, note, strategies as st

from fixtures.core.comparison import assert_bitwise
from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.core.outcomes import must_fire, not_applicable
from fixtures.checks.workloads import assert_same_completions, engine_settings, long_request, random_ids, requests

pytestmark = pytest.mark.C4


def assert_decode_equals_prefill(engine, completions, **context):
    __tracebackhide__ = True
    seqs, expect = [], []
    for c in completions:
        for s in c.samples:
            seqs.append(list(c.prompt_ids) + s.token_ids)
            expect.append(s.logprobs)
    prefilled = engine.prompt_logprobs(seqs)
    for seq, lp, want in zip(seqs, prefilled, expect):
        n = len(want)
        assert_bitwise(lp[len(seq) - 1 - n:], want, what="decode logprobs vs prompt logprobs of one prefill",
                       lhs_name="prefill", rhs_name="decode", prompt_tokens=len(seq) - n, **context)


@engine_settings()
@given(data=st.data())
def test_decode_equals_prefill(engine, proxy, data):
    batch = data.draw(requests(proxy.config.vocab_size, data.draw(st.sampled_from([1, 2, 7]), label="n")))
    assert_decode_equals_prefill(engine, engine.generate(batch))


@engine_settings(divisor=4, floor=2)
@given(budget=st.sampled_from([3, 7, 16, 17, 33]), extra=st.integers(1, 60), seed=st.integers(0, 99))
def test_chunked_prefill_equals_unchunked(engine_factory, proxy, budget, extra, seed):
    """Split points move with the budget: off and on KV-block boundaries (16), prompts past it."""
    length = budget + extra
    with engine_factory(EngineSettings(enable_chunked_prefill=False, max_num_batched_tokens=1024)) as whole:
        reference = whole.generate([long_request(proxy.config.vocab_size, length, seed)])
    with engine_factory(EngineSettings(enable_chunked_prefill=True, max_num_batched_tokens=budget)) as chunked:
        if not chunked.capabilities().chunked_prefill:
            not_applicable("no chunked prefill", feature="chunked_prefill")
        split = chunked.generate([long_request(proxy.config.vocab_size, length, seed)])
        stats = chunked.last_stats()
    note(f"prompt {length} tokens, budget {budget}: {stats}")
    assert length > budget and stats.chunked_prompts > 0, \
        f"the prompt ({length} tokens) was never split under a budget of {budget}: {stats}"
    assert_bitwise(split[0].prompt_logprobs, reference[0].prompt_logprobs, what="prompt logprobs",
                   lhs_name=f"chunked (budget {budget})", rhs_name="unchunked")
    assert_same_completions(split, reference, lhs=f"chunked (budget {budget})", rhs="unchunked")


def test_prefix_cache_hit_equals_cold_start(engine_factory, proxy):
    vocab = proxy.config.vocab_size
    shared = list(random_ids(vocab, 70, seed=11))
    first = Request("warm", tuple(shared + [1, 2, 3]), SamplingParams(max_tokens=3))
    probe = Request("probe", tuple(shared + [4, 5]), SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    with engine_factory(EngineSettings(enable_prefix_caching=False)) as cold_engine:
        cold = cold_engine.generate([probe])
        assert cold[0].num_cached_tokens == 0
    with engine_factory(EngineSettings(enable_prefix_caching=True)) as cached:
        if not cached.capabilities().prefix_cache:
            not_applicable("no prefix cache", feature="prefix_cache")
        cached.generate([first])
        hit = cached.generate([probe])
    assert hit[0].num_cached_tokens > 0, "declared prefix cache never read: the probe had 0 cached tokens"
    assert_same_completions(hit, cold, lhs=f"prefix-cache hit ({hit[0].num_cached_tokens} cached tokens)",
                            rhs="cold start")


def test_preemption_resume_equals_uninterrupted(engine_factory, engine, proxy):
    if not engine.capabilities().preemption:
        not_applicable("no preemption", feature="preemption")
    # 48 new tokens each: with a few requests running, block demand grows past the 12-block cache
    # even under a scheduler that admits a request only when its whole prompt fits (vLLM).
    batch = [long_request(proxy.config.vocab_size, 30 + 7 * i, seed=i, max_tokens=48) for i in range(6)]
    batch = [Request(r.request_id, r.prompt_ids, r.params) for r in batch]
    uninterrupted = engine.generate(batch)
    with engine_factory(EngineSettings(kv_cache_blocks=12)) as small:
        squeezed = small.generate(batch)
        stats = small.last_stats()
    assert stats.preemptions > 0, f"no preemption happened with a 12-block KV cache: {stats}"
    assert_same_completions(squeezed, uninterrupted, lhs=f"with {stats.preemptions} preemptions",
                            rhs="uninterrupted")


def test_control_stock_decode_differs_from_prefill(engine_factory, proxy):
    """Negative control: with stock kernels one-token decode GEMMs and multi-row prefill GEMMs
    round differently on this CPU; if not, the check is inconclusive here."""
    batch = [Request(f"c{i}", tuple(range(3 + i, 40 + i)), SamplingParams(max_tokens=8)) for i in range(3)]
    with engine_factory(EngineSettings(batch_invariant=False)) as stock:
        completions = stock.generate(batch)
        with must_fire("stock decode equalled stock prefill",
                       tried="3 prompts of 37 tokens, 8 decode steps vs one prefill, stock kernels"):
            assert_decode_equals_prefill(stock, completions)
