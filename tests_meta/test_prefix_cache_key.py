"""A prefix cache whose block key ignores what came before the block (issue #44 item 5).

The planted fault prefix_cache_key_ignores_prefix keys each full block of the reference engine's
prefix cache by its own token ids: a block-size chunk cached after one prefix is served after
another prefix or at another offset. Here, directly:
- the planted engine really serves a wrong block: on a crafted prompt (the chunk at offset 0,
  cached at offset 16 after another block) it reads 16 cached tokens where a correct key reads
  none, and its logprobs differ from a cold engine's; unplanted, it reads none and equals cold;
- C4's prefix-cache hit check (a probe shares its whole prefix with its warm-up) passes with it
  planted - the blind spot - and C4's chunk-elsewhere check reports it, stating both sides;
- the undo puts the chained key back; an engine without that key refuses the fault by name.
"""
from __future__ import annotations

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.checks.workloads import random_ids
from fixtures.faults.catalog import FAULTS
from fixtures.faults.variants import FaultUnavailable
from fixtures.models.proxies import build_proxy
from fixtures.reference.engine import ReferenceEngine
from fixtures.reference.kv_cache import BLOCK_SIZE
from tests_c5_invariance.test_c4_prefill_decode import (test_prefix_cache_chunk_elsewhere_equals_cold_start as
                                                        c4_chunk_elsewhere,
                                                        test_prefix_cache_hit_equals_cold_start as c4_prefix_hit)

FAULT = "prefix_cache_key_ignores_prefix"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_proxy("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"), seed=0)


def _crafted(vocab: int) -> tuple[Request, Request]:
    """(owner, probe): the owner holds a chunk of one block after another block; the probe starts
    with the same chunk (offset 0, nothing before it) and then goes its own way. Greedy."""
    prefix, chunk = list(random_ids(vocab, BLOCK_SIZE, seed=1)), list(random_ids(vocab, BLOCK_SIZE, seed=2))
    owner = Request("owner", tuple(prefix + chunk + [3, 4, 5]), SamplingParams(max_tokens=2))
    probe = Request("probe", tuple(chunk + [6, 7, 8]), SamplingParams(max_tokens=6))
    return owner, probe


def _warm_probe(engine, owner, probe):
    engine.reset_prefix_cache()
    engine.generate([owner])
    return engine.generate([probe])[0]


def test_planted_engine_serves_a_block_cached_elsewhere(qwen3):
    fault = FAULTS[FAULT]
    assert (fault.gate, fault.kind, fault.model) == ("C4", "engine", "qwen3")
    owner, probe = _crafted(qwen3.config.vocab_size)
    with ReferenceEngine(qwen3.path) as cold_engine:
        cold = cold_engine.generate([probe])[0]
    assert cold.num_cached_tokens == 0
    with ReferenceEngine(qwen3.path) as engine:
        right = _warm_probe(engine, owner, probe)       # the chained key: the chunk is not this prompt's prefix
        assert right.num_cached_tokens == 0
        assert right.samples[0].token_ids == cold.samples[0].token_ids
        assert torch.equal(right.samples[0].logprobs, cold.samples[0].logprobs)
        with fault.active(engine):
            wrong = _warm_probe(engine, owner, probe)
            assert wrong.num_cached_tokens == BLOCK_SIZE, "the planted key did not serve the chunk cached at offset 16"
            assert not torch.equal(wrong.samples[0].logprobs[:1], cold.samples[0].logprobs[:1]), \
                "a block of K/V from offset 16 after another block gave the cold logprobs: the fault shows nothing"
        assert "_block_hash" not in engine.__dict__        # undone: the chained key again
        again = _warm_probe(engine, owner, probe)
        assert again.num_cached_tokens == 0 and torch.equal(again.samples[0].logprobs, cold.samples[0].logprobs)


def test_c4_whole_prefix_check_is_blind_and_chunk_elsewhere_check_reports_it(qwen3):
    factory = lambda settings=EngineSettings(): ReferenceEngine(qwen3.path, settings)   # noqa: E731
    with ReferenceEngine(qwen3.path) as engine:
        c4_chunk_elsewhere(factory, engine, qwen3)        # clean: passes
        with FAULTS[FAULT].active(engine):
            c4_prefix_hit(factory, engine, qwen3)         # the blind spot: a whole shared prefix is keyed right
            with pytest.raises(BitwiseMismatch) as caught:
                c4_chunk_elsewhere(factory, engine, qwen3)
    text = str(caught.value)
    assert "chunk-first sample 0 sampled-token logprobs" in text, text
    assert f"warm ({BLOCK_SIZE} cached tokens; 0 shared with a warm-up sequence) != cold start" in text, text
    assert "state cold start: started cold (prefix cache reset); 0 cached prompt tokens; " in text, text


def test_fault_refuses_an_engine_without_a_chained_block_key():
    class NoPrefixCache:
        cache = None
    with pytest.raises(FaultUnavailable, match="NoPrefixCache keys no block prefix cache"):
        FAULTS[FAULT].plant(NoPrefixCache())


def test_the_probes_block_is_the_reference_engines():
    from fixtures.checks.workloads import PREFIX_CACHE_BLOCK
    from fixtures.reference.kv_cache import BLOCK_SIZE
    assert PREFIX_CACHE_BLOCK == BLOCK_SIZE
