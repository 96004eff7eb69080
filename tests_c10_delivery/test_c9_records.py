"""Gate C9 from records (--records, docs/records.md): two or more RL steps, each exactly on
policy; weights changed by the optimizer step and pushed, engine = trainer per-tensor hash at each
pushed version; prompts re-sent after a push not served from a cache of the old weights.
Inconclusive with one step, no hashes after a push, or no re-sent prompt."""
from __future__ import annotations

import pytest

from fixtures.plugin.records import judged
from fixtures.records.judge import judge_two_steps

pytestmark = [pytest.mark.C9, pytest.mark.records]


def test_records_two_rl_steps(pytestconfig, record_metric):
    for name, value in judged(judge_two_steps, pytestconfig).items():
        record_metric(f"records_{name}", value)
