"""Every engine completion is shape-checked before a value is compared
(fixtures.checks.completion_shapes): one line naming the request, the sample and both lengths;
planted: fixtures.faults.catalog's logprobs_one_short fires at C3 through the engine fixture."""
from __future__ import annotations

import pytest
import torch

from fixtures.checks.completion_shapes import CompletionShapeError, check_completions, shape_checked
from fixtures.core.contract import Completion, Request, Sample, SamplingParams


def _req(rid="r0", prompt=(1, 2, 3), prompt_logprobs=False):
    return Request(rid, tuple(prompt), SamplingParams(max_tokens=3, seed=1), want_prompt_logprobs=prompt_logprobs)


def _comp(rid="r0", ids=(4, 5, 6), n_lp=3, prompt=(1, 2, 3), n_prompt_lp=None):
    return Completion(rid, tuple(prompt), [Sample(list(ids), torch.zeros(n_lp))],
                      prompt_logprobs=None if n_prompt_lp is None else torch.zeros(n_prompt_lp))


def test_right_shapes_pass():
    check_completions([_req(), _req("r1", prompt_logprobs=True)], [_comp(), _comp("r1", n_prompt_lp=2)])


@pytest.mark.parametrize("reqs, comps, needle", [
    ([_req()], [_comp(n_lp=2)], "returned 2 logprobs for 3 sampled tokens (request 'r0', sample 0)"),
    ([_req()], [_comp(n_lp=4)], "returned 4 logprobs for 3 sampled tokens"),
    ([_req(), _req("r1")], [_comp()], "returned 1 completions for 2 requests"),
    ([_req(), _req("r1")], [_comp("r1"), _comp()], "completion 'r1' where request 'r0' was"),
    ([_req(prompt_logprobs=True)], [_comp(n_prompt_lp=3)], "3 prompt logprobs for a 3-token prompt"),
])
def test_a_wrong_shape_is_one_line_before_any_value(reqs, comps, needle):
    with pytest.raises(CompletionShapeError) as err:
        check_completions(reqs, comps, engine="Stub")
    assert needle in str(err.value) and "\n" not in str(err.value)


class _Stub:
    def __init__(self, short: bool):
        self.short = short

    def generate(self, requests):
        return [_comp(r.request_id, n_lp=2 if self.short else 3) for r in requests]

    def prompt_logprobs(self, seqs):
        return [torch.zeros(len(s) - (2 if self.short else 1)) for s in seqs]


def test_shape_checked_engines_keep_their_class_and_check_every_call():
    good, bad = shape_checked(_Stub(False)), shape_checked(_Stub(True))
    assert type(good) is _Stub and shape_checked(good) is good
    good.generate([_req()])
    good.prompt_logprobs([[1, 2, 3]])
    with pytest.raises(CompletionShapeError, match="_Stub returned 2 logprobs for 3 sampled tokens"):
        bad.generate([_req()])
    with pytest.raises(CompletionShapeError, match=r"1 logprobs for sequence 0 of 3 tokens"):
        bad.prompt_logprobs([[1, 2, 3]])
