"""Gate C6 from records (--records, docs/records.md): a sequence recorded in two or more trainer
micro-batch compositions (members, position, layout) has the same logprob bits in each.
Inconclusive where no sequence was recorded in a second composition."""
from __future__ import annotations

import pytest

from fixtures.plugin.records import judged
from fixtures.records.judge import judge_composition

pytestmark = [pytest.mark.C6, pytest.mark.records]


def test_records_composition_invariance(pytestconfig, record_metric):
    for name, value in judged(judge_composition, pytestconfig).items():
        record_metric(f"records_{name}", value)
