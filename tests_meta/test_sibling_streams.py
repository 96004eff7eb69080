"""Planted siblings_share_one_stream (fixtures.faults.engine_state): the n samples of a request on
one random stream change with the schedule and still equal their own prefill - so only C5's
comparison across schedules (test_samples_of_a_prompt_whatever_their_step_mates) can see it."""
from __future__ import annotations

import torch

from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.faults.catalog import FAULTS
from fixtures.models.proxies import build_proxy
from fixtures.reference.engine import ReferenceEngine

REQ = Request("n4", tuple(range(5, 21)), SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=4))


def _tokens(engine):
    return [tuple(s.token_ids) for s in engine.generate([REQ])[0].samples]


def test_a_shared_stream_changes_with_the_schedule_and_not_without_it(tmp_path):
    proxy = build_proxy("llama", "tiny", tmp_path / "p")
    with ReferenceEngine(proxy.path) as together, ReferenceEngine(proxy.path, EngineSettings(max_num_seqs=1)) as alone:
        assert _tokens(together) == _tokens(alone)                    # control: per-sample streams
        with FAULTS["siblings_share_one_stream"].active(together) as a, \
                FAULTS["siblings_share_one_stream"].active(alone) as b:
            x, y = _tokens(a), _tokens(b)
            assert x != y, "the planted shared stream did not depend on the schedule"
            assert x == _tokens(a), "the planted stream must start afresh at every generate()"
            sample = a.generate([REQ])[0].samples[0]
            prefill = a.prompt_logprobs([list(REQ.prompt_ids) + sample.token_ids])[0]
            assert torch.equal(prefill[len(REQ.prompt_ids) - 1:], sample.logprobs)   # its own prefill: equal
        assert _tokens(together) == _tokens(alone)                    # undone
