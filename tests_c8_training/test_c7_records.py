"""Gate C7 from records (--records, docs/records.md): the trainer's logprob of every recorded
sampled token equals the engine's, bit for bit - k1 = k3 = max |diff| = mismatch fraction = 0 -
for trainer passes at the weight version the rollout was sampled under. Inconclusive where no
recorded engine step or trainer micro-batch reaches 256 tokens."""
from __future__ import annotations

import pytest

from fixtures.plugin.records import judged
from fixtures.records.judge import judge_parity

pytestmark = [pytest.mark.C7, pytest.mark.records]


def test_records_trainer_equals_engine(pytestconfig, record_metric):
    for name, value in judged(judge_parity, pytestconfig).items():
        record_metric(f"records_{name}", value)
