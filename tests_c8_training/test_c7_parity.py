"""Gate C7 - Train-inference parity: for engine rollouts (temperature 1, several samples per
prompt, different lengths), the trainer's logprobs of the sampled tokens equal the engine's
sampled-token logprobs and the engine's prompt logprobs of the full sequence; k1, k3, max abs
diff and mismatch fraction are all exactly 0. Trainer and engine use the same TP degree, and a
trainer that can compute at another one must be seen to differ there."""
from __future__ import annotations

import pytest

import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import Layout, supported_layouts
from fixtures.diagnose.module_outputs import compare_module_outputs
from fixtures.checks.rollouts import assert_parity, collect, rollout_requests

pytestmark = pytest.mark.C7


@pytest.fixture(scope="module")
def rollouts(engine, proxy):
    return collect(engine.generate(rollout_requests(proxy.config.vocab_size, 4, seed=1, n=2)))


def test_same_tensor_parallel_degree(engine, trainer):
    """A different TP degree splits reductions differently and can never match (the control
    below shows it does not)."""
    e, t = getattr(engine, "tensor_parallel_size", 1), getattr(trainer, "tensor_parallel_size", 1)
    assert e == t, f"engine TP={e} vs trainer TP={t}: parity needs the same tensor-parallel degree"


def test_control_other_tensor_parallel_degree_breaks_parity(engine, trainer, rollouts):
    """Negative control for the TP claim, both ways: the same trainer computing as vLLM at another
    TP degree (TP=2 against a TP=1 engine, TP=1 against a TP>1 one) must report a difference -
    else the trainer's TP arithmetic is not what decides parity."""
    if not hasattr(trainer, "at_tensor_parallel"):
        pytest.skip("n/a: the trainer cannot compute at another tensor-parallel degree")
    e = getattr(engine, "tensor_parallel_size", 1)
    other = 1 if e > 1 else 2
    try:
        with trainer.at_tensor_parallel(other):
            assert_parity(engine, trainer, rollouts)
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    except (BitwiseMismatch, AssertionError):
        return
    pytest.skip(f"inconclusive: the trainer at TP={other} arithmetic matched the TP={e} engine bit for bit")


def test_trainer_reads_logprobs_as_the_engine_samples(engine, trainer):
    """vLLM 0.26's two model runners report a logprob through different kernels (V2: a Triton
    top-k log-softmax; V1: log_softmax in float32): a trainer copying the engine's arithmetic must
    copy the one this engine runs."""
    theirs, mine = getattr(engine, "model_runner", None), getattr(getattr(trainer, "ops", None), "sampler", None)
    if theirs is None or mine is None:
        pytest.skip("n/a: the engine or the trainer names no sampler")
    assert mine == theirs, f"trainer computes logprobs like vLLM's {mine} runner; the engine runs {theirs}"


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


def _module_probe(proxy) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, proxy.config.vocab_size, (37,), generator=g).tolist()


def _module_recorders(engine, trainer):
    if not (hasattr(engine, "module_outputs") and hasattr(trainer, "module_outputs")):
        pytest.skip("n/a: module-by-module parity needs an engine and a trainer that record their module outputs "
                    "under one naming (vLLM + the engine-kernel trainer)")


def test_every_module_output_equals_engine(engine, trainer, proxy, record_metric):
    """One prefill, every module output: the engine's (forward hooks in its worker) vs the
    trainer's at the same point. Equal final logprobs with a differing intermediate would be luck;
    a differing point is named, with everything upstream of it equal."""
    _module_recorders(engine, trainer)
    seq = _module_probe(proxy)
    try:
        theirs = engine.module_outputs(seq)
    except NotImplementedError as exc:          # e.g. TP > 1: the modules live in vLLM's worker processes
        pytest.skip(str(exc))
    result = compare_module_outputs(theirs, trainer.module_outputs(seq, naming=getattr(engine, "module_naming", "vllm")))
    record_metric("module_points_compared", len(result.compared))
    record_metric("module_points_differing", len(result.differing_points))
    assert result.compared, result.describe()
    assert result.equal, "engine vs trainer module outputs (bitwise):\n" + result.describe()


def test_control_planted_ulp_is_named(trainer, proxy):
    """Negative control for the comparison above: the trainer against itself with one op's
    output moved by one ULP must name exactly that op's module, with everything upstream equal."""
    if not hasattr(trainer, "module_outputs") or not hasattr(trainer, "ops"):
        pytest.skip("n/a: the trainer records no module outputs")
    import contextlib
    from fixtures.vllm.trainer import PlantedULP
    seq = _module_probe(proxy)
    whole = trainer.at_tensor_parallel(1) if hasattr(trainer, "at_tensor_parallel") else contextlib.nullcontext()
    with whole:                 # every point recorded whole (a TP>1 trainer records only the all-reduced ones)
        clean = trainer.module_outputs(seq)
        ops = trainer.ops
        trainer.ops = PlantedULP(ops, op="silu_and_mul", call=0) if "model.layers.0.mlp.act_fn" in clean \
            else PlantedULP(ops, op="linear", call=1)
        try:
            planted = trainer.module_outputs(seq)
        finally:
            trainer.ops = ops
    result = compare_module_outputs(list(clean.items()), planted, names=("trainer", "planted trainer"))
    expected = "model.layers.0.mlp.act_fn" if "model.layers.0.mlp.act_fn" in clean else "model.layers.0.self_attn.o_proj"
    assert result.first == expected, result.describe()
    assert "1 of" in result.detail and "1 ULP apart" in result.detail, result.detail


def test_control_stock_trainer_breaks_parity(engine, proxy, rollouts):
    """Negative control: the same parity check with a trainer on stock kernels and eager
    attention must report a difference."""
    from fixtures.reference.hf_trainer import HFTrainer
    stock = HFTrainer(proxy.path, attn_implementation="eager")
    try:
        assert_parity(engine, stock, rollouts)
    except (BitwiseMismatch, AssertionError):
        return
    pytest.skip("inconclusive on this hardware: a stock trainer matched the invariant engine bit for bit")
