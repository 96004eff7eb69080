"""Gate C7 - Train-inference parity: for engine rollouts (temperature 1, several samples per
prompt, different lengths), the trainer's logprobs of the sampled tokens equal the engine's
sampled-token logprobs and the engine's prompt logprobs of the full sequence; k1, k3, max abs
diff and mismatch fraction are all exactly 0. Trainer and engine use the same TP degree."""
from __future__ import annotations

import pytest

from fixtures.comparison import BitwiseMismatch
from fixtures.contract import Layout, supported_layouts
from fixtures.rollouts import assert_parity, collect, rollout_requests

pytestmark = pytest.mark.C7


@pytest.fixture(scope="module")
def rollouts(engine, proxy):
    return collect(engine.generate(rollout_requests(proxy.config.vocab_size, 4, seed=1, n=2)))


def test_same_tensor_parallel_degree(engine, trainer):
    """A different TP degree splits reductions differently and can never match."""
    e, t = getattr(engine, "tensor_parallel_size", 1), getattr(trainer, "tensor_parallel_size", 1)
    assert e == t, f"engine TP={e} vs trainer TP={t}: parity needs the same tensor-parallel degree"


@pytest.mark.parametrize("layout", list(Layout), ids=lambda l: l.value)
def test_trainer_equals_engine(engine, trainer, rollouts, layout, record_metric):
    if layout not in supported_layouts(trainer):
        pytest.skip(f"n/a (declared): the trainer has no {layout.value} layout for this architecture")
    assert len({len(r.token_ids) for r in rollouts}) > 1, "rollouts must finish at different lengths"
    assert_parity(engine, trainer, rollouts, layout=layout, record=record_metric)


def test_greedy_and_low_temperature_rollouts(engine, trainer, proxy, record_metric):
    for temperature in (0.0, 0.6):
        rs = collect(engine.generate(rollout_requests(proxy.config.vocab_size, 3, seed=2, n=1,
                                                      temperature=temperature)))
        assert_parity(engine, trainer, rs, record=record_metric if temperature else None)


def test_control_stock_trainer_breaks_parity(engine, proxy, rollouts):
    """Negative control: the same parity check with a trainer on stock kernels and eager
    attention must report a difference."""
    from fixtures.hf_trainer import HFTrainer
    stock = HFTrainer(proxy.path, attn_implementation="eager")
    try:
        assert_parity(engine, stock, rollouts)
    except (BitwiseMismatch, AssertionError):
        return
    pytest.skip("inconclusive on this hardware: a stock trainer matched the invariant engine bit for bit")
