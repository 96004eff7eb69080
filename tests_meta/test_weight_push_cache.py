"""Weights change, caches must not lie (issue #19 item 2): after a weight push a prompt served
before it must be computed from the new weights.

- the reference engine's load_weights invalidates its prefix cache; the planted
  `prefix_cache_survives_weight_push` keeps it (the control), and undoes cleanly;
- C4's "prefix-cache hit after a weight update = cold" passes on the reference engine and, with
  the fault planted, fails saying the cached prompt tokens were served from before the push, with
  both sides' engine state;
- C9's step 2 (step 1's prompts re-sent after the push) catches the same fault against a cold
  engine, before the trainer comparison;
- the vLLM client (fake worker, no vLLM): a reload resets the prefix cache, and a worker whose
  reset is refused makes load_weights fail instead of serving the old weights' K/V.
"""
from __future__ import annotations

import json

import pytest
import torch

from fixtures.checks.weight_push import checkpoint_weights, moved_weights
from fixtures.checks.workloads import PARITY_CPU, random_ids
from fixtures.core.comparison import BitwiseMismatch
from fixtures.runtime.costs import Phases
from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.faults.catalog import FAULTS
from fixtures.models.proxies import build_proxy
from fixtures.reference.engine import ReferenceEngine
from fixtures.reference.implementation import ReferenceImplementation
from tests_c5_invariance.test_c4_prefill_decode import test_prefix_cache_hit_after_weight_update_equals_cold as c4_check
from tests_c10_delivery.test_c9_rl import test_two_rl_steps_stay_exactly_on_policy as c9_check

FAULT = "prefix_cache_survives_weight_push"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_proxy("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"), seed=0)


def _cached_after_push(engine, proxy) -> tuple[int, int]:
    """(cached prompt tokens of a 40-token prompt re-sent before a push, the same after it)."""
    request = Request("r", tuple(random_ids(proxy.config.vocab_size, 40, seed=3)), SamplingParams(max_tokens=2))
    engine.generate([request])
    before = engine.generate([request])[0].num_cached_tokens
    engine.load_weights(moved_weights(checkpoint_weights(proxy.path)))
    return before, engine.generate([request])[0].num_cached_tokens


def test_reference_load_weights_invalidates_the_prefix_cache(qwen3):
    with ReferenceEngine(qwen3.path) as engine:
        assert _cached_after_push(engine, qwen3) == (32, 0)
    fault = FAULTS[FAULT]
    assert fault.gate == "C4" and fault.kind == "engine"
    with ReferenceEngine(qwen3.path) as engine:
        with fault.active(engine):                          # control: the planted reload keeps the cache
            assert _cached_after_push(engine, qwen3) == (32, 32)
        assert "load_weights" not in engine.__dict__        # undone: the class's load_weights again
        assert _cached_after_push(engine, qwen3) == (32, 0)


def _factory(proxy, fault=None):
    def make(settings=EngineSettings()):
        engine = ReferenceEngine(proxy.path, settings)
        return FAULTS[fault].wrap_engine(engine) if fault else engine
    return make


@pytest.mark.parametrize("model", ["qwen3", "nemotron_h"])
def test_c4_check_reports_cached_tokens_served_from_before_the_push(model, qwen3, tmp_path):
    proxy = qwen3 if model == "qwen3" else build_proxy(model, "tiny", tmp_path, seed=0)
    c4_check(_factory(proxy), proxy, ReferenceImplementation())                         # clean: every run on the new weights agrees
    with pytest.raises(BitwiseMismatch) as caught:
        c4_check(_factory(proxy, FAULT), proxy, ReferenceImplementation())
    text = str(caught.value)
    assert "after the push (16 cached tokens) != cold start on the new weights" in text, text
    assert "16 cached prompt tokens were served from before the weight push" in text, text
    assert "state after the push (16 cached tokens): started warm from before the weight push" in text, text
    assert "; 16 cached prompt tokens; " in text, text
    assert "state cold start on the new weights: started cold (prefix cache reset); 0 cached prompt tokens" in text, text


def _c9(proxy, fault=None) -> dict:
    """C9's two-step check on the reference stack, as the gate runs it; its metrics."""
    metrics = {}
    engine = _factory(proxy, fault)()
    trainer = ReferenceImplementation().make_trainer(proxy.path)
    try:
        c9_check((engine, trainer), proxy, (PARITY_CPU, PARITY_CPU.micro_batch_tokens), Phases("C9 phases"),
                 metrics.__setitem__)
    finally:
        engine.close()
        trainer.close()
    return metrics


def test_c9_step_two_repeat_catches_the_stale_cache(qwen3):
    metrics = _c9(qwen3)
    assert metrics["step1_prompt_tokens_held_at_push"] > 0 and metrics["step2_cached_prompt_tokens"] == 0, metrics
    with pytest.raises(BitwiseMismatch) as caught:
        _c9(qwen3, FAULT)
    text = str(caught.value)
    assert "step 2 after the push (16 cached tokens) != cold start on the new weights" in text, text
    assert "if the prefix cache kept those blocks, they were served from before the weight push" in text, text
    assert "state step 2 after the push (16 cached tokens): started warm from step 1" in text, text
    assert "state cold start on the new weights: started cold (prefix cache reset); 0 cached prompt tokens" in text, text


@pytest.mark.parametrize("mode", ["echo", "keep_cache_on_reload"])
def test_vllm_client_reload_resets_the_prefix_cache(mode, tmp_path):
    from fixtures.vllm.client import VLLMEngine
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    request = Request("r", tuple(range(40)), SamplingParams(max_tokens=2))
    with VLLMEngine(tmp_path, fake=mode, log_dir=tmp_path) as engine:
        engine.generate([request])
        assert engine.generate([request])[0].num_cached_tokens == 32
        if mode == "echo":
            engine.load_weights({"w": torch.ones(3)})
            assert engine.generate([request])[0].num_cached_tokens == 0
            return
        with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):   # control
            engine.load_weights({"w": torch.ones(3)})


def test_moved_weights_move_every_float_tensor_and_leave_the_input_alone():
    """Every floating tensor moves (an all-zero one too), integers stay, dtypes and devices are
    kept, the same seed gives the same bits, and the caller's tensors are untouched - a float32
    tensor included, which `.to(float32)` would hand back uncopied (C4 pushes the originals back)."""
    import torch
    weights = {"w": torch.randn(64, 32, dtype=torch.bfloat16), "norm": torch.zeros(7), "f32": torch.randn(9, 3),
               "ids": torch.arange(4)}
    kept = {k: v.clone() for k, v in weights.items()}
    moved = moved_weights(weights)
    assert all(torch.equal(weights[k], kept[k]) for k in weights), "moved_weights changed its input"
    assert [k for k in weights if torch.equal(moved[k], weights[k])] == ["ids"]
    assert all(moved[k].dtype == weights[k].dtype and moved[k].device == weights[k].device for k in weights)
    again = moved_weights(weights)
    assert all(torch.equal(moved[k], again[k]) for k in weights)
