"""C3/C4/C5's stated engine states and rows found by request (issues #18 item 6, #19 items 1 and 5).

- a planted fault in the reference engine's cached-KV path (a prefix-cache hit reads its K/V back
  through bf16) is C4's prefix-cache check's to report, not C3's: C3 runs both sides cold. The
  control: the same needle comparison with the batch run warm (as C3 ran it before) does see it;
- a failure prints, for both sides, the cached prompt tokens and the tokens of each step;
- a needle whose prompt three requests of one step share is localised by request, to the planted
  module, in the reference engine and through the vLLM worker's request locator (no vLLM: a
  stand-in model runner); the token-content fallback cannot tell those rows apart (the control);
- C5's arrival order runs every order cold, so a cache-hit fault stays C4's (control: warm orders
  see it), and its failure states both sides.
"""
from __future__ import annotations

import types

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.core.traces import RequestTrace
from fixtures.diagnose.engine_rows import EngineRows, StepRows, localise_in_engine, rows_by_layout, start_from
from fixtures.diagnose.module_outputs import locate_prompt_rows
from fixtures.checks.workloads import (assert_same_completion, assert_same_completions, fixed_batch,
                                      mixed_workload, random_ids)
from fixtures.faults.catalog import FAULTS
from fixtures.models.proxies import build_proxy
from fixtures.reference.engine import ReferenceEngine
from tests_c5_invariance.test_c3_engine_batch import compare_needle
from tests_c5_invariance.test_c4_prefill_decode import test_prefix_cache_hit_equals_cold_start as c4_prefix_check
from tests_c5_invariance.test_c5_scheduling import run_cold, test_arrival_order as c5_arrival_order


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_proxy("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"), seed=0)


def _needle_case(vocab: int):
    """A needle of 40 tokens (two full KV blocks) in the middle of 8 others, one engine step."""
    batch = fixed_batch(vocab, 8, seed=4)
    needle = Request("needle", tuple(random_ids(vocab, 40, seed=9)), SamplingParams(max_tokens=4, temperature=1.0,
                                                                                   seed=1))
    return needle, batch[:4] + [needle] + batch[4:], 4


def test_cached_kv_fault_is_not_batch_variance(qwen3):
    fault = FAULTS["prefix_cache_kv_bf16"]
    assert fault.gate == "C4"
    needle, batch, pos = _needle_case(qwen3.config.vocab_size)
    with ReferenceEngine(qwen3.path) as engine, fault.active(engine):
        compare_needle(engine, needle, batch, pos)          # both sides cold: nothing to see
        # control: alone cold, then the batch on the warm cache (C3's old order) - the needle
        # reads its cached blocks in the batch, and the planted read-back shows as "batch variance"
        start_from(engine)
        alone = engine.generate([needle])[0]
        inside = engine.generate(batch)[pos]
        assert engine.last_stats().requests["needle"].cached_prompt_tokens == 32
        with pytest.raises(BitwiseMismatch):
            assert_same_completion(alone, inside, lhs="alone", rhs="in the batch, warm")


def _c4_prefix(engine, proxy):
    c4_prefix_check(lambda settings=EngineSettings(): ReferenceEngine(proxy.path, settings), engine, proxy)


def test_c4_prefix_check_reports_the_cached_kv_fault_with_both_states(qwen3):
    with ReferenceEngine(qwen3.path) as engine:
        _c4_prefix(engine, qwen3)                           # clean: a hit equals a cold start
        with FAULTS["prefix_cache_kv_bf16"].active(engine), pytest.raises(BitwiseMismatch) as caught:
            _c4_prefix(engine, qwen3)
    text = str(caught.value)
    assert "prefix-cache hit (16 cached tokens) != cold start" in text, text
    assert "state prefix-cache hit (16 cached tokens): started warm (deliberately" in text, text
    assert "; 16 cached prompt tokens; " in text and "state cold start: started cold (prefix cache reset); " \
        "0 cached prompt tokens; " in text, text


def test_reference_engine_reports_each_requests_steps(qwen3):
    vocab = qwen3.config.vocab_size
    a = Request("a", tuple(random_ids(vocab, 20, seed=1)), SamplingParams(max_tokens=3))
    b = Request("b", a.prompt_ids[:16] + (1, 2, 3), SamplingParams(max_tokens=2))
    with ReferenceEngine(qwen3.path) as engine:
        engine.generate([a, b])
        traces = engine.last_stats().requests
        assert traces["a"] == RequestTrace(0, (39, 2, 1), (20, 1, 1)) and traces["b"] == RequestTrace(0, (39, 2), (19, 1))
        engine.generate([b])
        assert engine.last_stats().requests["b"] == RequestTrace(16, (3, 1), (3, 1))
    assert traces["a"].describe() == "0 cached prompt tokens; 3 steps (tokens in the step/its own): 39/20, 2/1, 1/1"


def _copies_batch(vocab: int):
    """The needle's prompt three times in one step of the reference engine (>= 64 rows)."""
    batch = fixed_batch(vocab, 9, seed=5)
    prompt = tuple(random_ids(vocab, 30, seed=2))
    needle = Request("needle", prompt, SamplingParams(max_tokens=3))
    batch[2], batch[6], batch[4] = Request("copy-a", prompt), Request("copy-b", prompt), needle
    return needle, batch, 4


def _nudged_from_64_rows(_module, _args, out):
    """A projection whose output moves (by 2^-12 of itself) when the step has >= 64 rows: its bits
    depend on how many tokens share the step (a planted row fault; a forward hook, so the rows the
    engine records downstream of it see it)."""
    if out.numel() // out.shape[-1] >= 64:           # rows of [T, H] or [1, T, H]
        return out + out.abs() * 2.0 ** -12
    return None


def test_repeated_prompt_localises_by_request_in_the_reference_engine(qwen3):
    target = "model.layers.1.mlp.down_proj"
    needle, batch, pos = _copies_batch(qwen3.config.vocab_size)
    with ReferenceEngine(qwen3.path) as engine:
        compare_needle(engine, needle, batch, pos)
        plant = engine.module().get_submodule(target).register_forward_hook(_nudged_from_64_rows)
        try:
            with pytest.raises(BitwiseMismatch) as caught:
                compare_needle(engine, needle, batch, pos)
        finally:
            plant.remove()
    assert engine.last_stats().requests["needle"].step_tokens[0] >= 64
    text = str(caught.value)
    assert f"first diverging op: token 0, {target} (Linear)" in text, text
    assert "rows mapped by request alone" in text and "rows mapped by request in the batch" in text, text
    assert "rerun at 4 in a batch of 9 reproduced the failing run's state" in text, text
    assert "state alone: started cold (prefix cache reset); 0 cached prompt tokens" in text, text


# ---------------------------------------------------------------------------------------------
# the vLLM worker's locator, with a stand-in model runner (no vLLM)
# ---------------------------------------------------------------------------------------------
class _Scale(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.weight


class _StepModel(torch.nn.Module):
    """forward(input_ids, positions) over one flattened step, row-wise only; `variant`: a
    step-size dependent term enters `norm`'s input (a planted batch-variant op)."""

    def __init__(self, variant=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens, self.mix, self.norm, self.variant = torch.nn.Embedding(60, 4), _Scale(4), _Scale(4), variant

    def forward(self, input_ids, positions):
        h = self.mix(self.embed_tokens(input_ids) + positions[:, None].float())
        return self.norm(h + input_ids.shape[0] * 1e-3 if self.variant else h)


def _backend(model):
    """A VLLMBackend whose model runner is a stand-in (its input_batch is set per step by _run)."""
    from fixtures.vllm.worker import VLLMBackend
    backend = VLLMBackend()
    backend.runner = types.SimpleNamespace(get_model=lambda: model, input_batch=types.SimpleNamespace(req_ids=[], num_reqs=0))
    return backend


def _run(backend, model, request, requests, steps, arrivals):
    """Drive `steps` [(row order [(vLLM id, ids, positions)])] through StepRows with the worker's locator."""
    backend.probe.reset()
    backend.probe.arrivals = arrivals
    rec = StepRows(model, backend.request_locator(request, requests))
    with rec, torch.no_grad():
        for rows in steps:
            backend.runner.input_batch.req_ids = [rid for rid, _, _ in rows]
            backend.runner.input_batch.num_reqs = len(rows)
            backend.probe.step_output = types.SimpleNamespace(num_scheduled_tokens={rid: len(i) for rid, i, _ in rows})
            model(input_ids=torch.tensor([t for _, i, _ in rows for t in i]),
                  positions=torch.tensor([p for _, _, ps in rows for p in ps]))
    out = EngineRows(request.request_id, mapped_by=rec.mapped_by, problem=rec.problem)
    for (p, _o, name, cls), t in rec.items():
        out.add(p, name, cls, t)
    return out


@pytest.mark.parametrize("variant", [False, True])
def test_worker_finds_the_needle_among_copies_by_request(variant):
    model = _StepModel(variant)
    prompt = [7, 3, 9, 9, 4]
    needle, copy = Request("needle", tuple(prompt)), Request("copy", tuple(prompt))
    other = Request("other", (1, 2))
    backend = _backend(model)
    alone = _run(backend, model, needle, [needle], [[("0-x", prompt, range(5))]], [("0-x", prompt)])
    # the batch: copy, other, needle - the runner lays them out as needle, copy, other
    arrivals = [("1-a", prompt), ("2-b", [1, 2]), ("3-c", prompt)]
    inside = _run(backend, model, needle, [copy, other, needle],
                  [[("3-c", prompt, range(5)), ("1-a", prompt, range(5)), ("2-b", [1, 2], range(2))]], arrivals)
    assert alone.mapped_by == inside.mapped_by == "request" and inside.problem is None
    assert len(alone.rows) == len(inside.rows) == 3 * len(prompt)
    found = alone.first_divergence(inside)
    if not variant:
        assert found is None
    else:
        assert found.startswith("token 0, norm (_Scale)") and "ULP" in found, found


def test_worker_falls_back_to_token_content_and_says_why():
    """Without a layout (or one that does not match the prompt) rows are found by content; a
    prompt repeated in the step then cannot be told apart - the control: the recording's problem
    says so, where the request locator found the rows."""
    model = _StepModel()
    prompt = [7, 3, 9, 9, 4]
    needle, copy = Request("needle", tuple(prompt)), Request("copy", tuple(prompt))
    backend = _backend(model)
    steps = [[("1-a", prompt, range(5)), ("2-b", prompt, range(5))]]
    wrong = [("1-a", prompt), ("2-b", [5, 5, 5, 5, 5])]     # vLLM's ids do not line up with the requests
    rec = _run(backend, model, needle, [copy, needle], steps, wrong)
    assert not rec.rows and "appear 2 times in one engine step" in rec.problem, rec.problem
    with pytest.raises(ValueError, match="cannot be told apart"):
        locate_prompt_rows(torch.tensor(prompt * 2), torch.tensor(list(range(5)) * 2), torch.tensor(prompt))
    with pytest.raises(ValueError, match="does not match the request's prompt tokens"):
        rows_by_layout([("1-a", 5), ("2-b", 5)], "2-b", torch.tensor([7, 3, 9, 9, 4, 0, 0, 0, 0, 0]),
                       torch.tensor(list(range(5)) * 2), prompt)
    ok = _run(backend, model, needle, [copy, needle], steps, [("1-a", prompt), ("2-b", prompt)])
    assert ok.mapped_by == "request" and len(ok.rows) == 3 * len(prompt)


def test_fake_worker_reports_traces_and_how_rows_were_found(tmp_path):
    import json
    from fixtures.vllm.client import VLLMEngine
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    needle = Request("needle", tuple(range(20)), SamplingParams(max_tokens=3))
    batch = [Request("a", (9, 9), SamplingParams(max_tokens=2)), needle]
    with VLLMEngine(tmp_path, fake="echo", log_dir=tmp_path) as eng:
        eng.generate(batch)
        assert eng.last_stats().requests["needle"] == RequestTrace(0, (22, 2, 2), (20, 1, 1))
        text = localise_in_engine(eng, needle, batch, 1)
    assert "rows mapped by request alone" in text and "rerun alone: started cold (prefix cache reset)" in text, text


@pytest.mark.parametrize("model_type, match", [
    ("kimi_linear", r"model\.layers\.0\.self_attn\.conv1d \(Conv1d\) is a convolution over tokens outside a block "
                    r"with a state path - the missing piece is an exact-replay state path for "),
    ("minimax", r"layer 1 is a state / linear-attention layer \(mamba\+moe\) holding none of them "
                r"\(self_attn \(MiniMaxLightningAttention\), ")], ids=["delta-attention-convs", "lightning-attention"])
def test_a_state_block_without_a_state_path_is_refused_by_name(tmp_path, model_type, match):
    """A block that keeps a state the engine has no path for is refused - n/a naming the block's
    class and the missing piece, never run over a packed row where it would mix the sequences:
    one with token convs no replay knows (Kimi-Linear's delta attention), and one the config alone
    calls linear attention (MiniMax's lightning attention: no A_log, no conv - before this rule the
    engine accepted it, measured)."""
    import json
    from transformers import CONFIG_MAPPING
    from fixtures.reference.engine import EngineUnsupported
    CONFIG_MAPPING[model_type]().save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config.setdefault("num_experts_per_tok", 8)        # Kimi-Linear's default config leaves it out
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    spec = build_proxy(tmp_path / "src", "tiny", tmp_path / "proxy")
    with pytest.raises(EngineUnsupported, match=rf"^n/a: the reference engine keeps states for .* only; {match}"):
        ReferenceEngine(spec.path)


def _decode_vs_prefill(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled-token logprobs of 12 greedy decode steps, and the same positions in one prefill
    of prompt + output."""
    prompt = tuple(range(3, 40, 2))
    (done,) = engine.generate([Request("shared", prompt, SamplingParams(max_tokens=12))])
    sample = done.samples[0]
    prefill = engine.prompt_logprobs([list(prompt) + list(sample.token_ids)])[0]
    return sample.logprobs, prefill[len(prompt) - 1:]


def test_a_shared_attention_block_keeps_a_kv_per_calling_layer(tmp_path):
    """Zamba2's hybrid layers call one shared attention block (tied weights; its own layer_idx is
    -1, the calling layer comes with each call). The family's own proxy keeps two of them calling
    one block (fixtures.models.reduce: kinds_sharing_blocks), and the engine keys the block's K/V by
    the calling layer, so decode equals prefill. Control: the catalog's
    shared_attention_kv_per_block (one K/V for all callers) - decode differs."""
    from fixtures.models.proxies import FAMILIES_DIR
    spec = build_proxy(FAMILIES_DIR / "zamba2", "tiny", tmp_path / "proxy")
    with ReferenceEngine(spec.path) as engine:
        assert len(engine.shared_attention) == 2, "two hybrid layers, each calling the shared block"
        decode, prefill = _decode_vs_prefill(engine)
        assert torch.equal(decode, prefill), (decode, prefill)
        with FAULTS["shared_attention_kv_per_block"].active(engine):
            decode, prefill = _decode_vs_prefill(engine)
        assert not torch.equal(decode, prefill), "the control: one K/V for both calling layers must show"


# ---------------------------------------------------------------------------------------------
# C5: every comparison starts cold, and a failure states both sides
# ---------------------------------------------------------------------------------------------
def _arrival_order(engine, vocab: int, perm) -> None:
    """C5's arrival-order check as the gate runs it, on its baseline from a cold cache."""
    reqs = mixed_workload(vocab)
    baseline = (reqs,) + run_cold(engine, "default", reqs)[:2]
    c5_arrival_order.hypothesis.inner_test(engine, baseline, perm)


def test_c5_arrival_order_starts_cold_so_a_cache_hit_fault_stays_c4s(qwen3):
    """prefix_cache_kv_bf16 changes only what a cache hit reads: C5's arrival order, each order
    from a cold cache, stays green with it planted. Control: the same orders on the warm cache (C5's
    old form) read the planted hits and go red."""
    perm, vocab = list(range(10))[::-1], qwen3.config.vocab_size
    with ReferenceEngine(qwen3.path) as engine, FAULTS["prefix_cache_kv_bf16"].active(engine):
        _arrival_order(engine, vocab, perm)
        reqs = mixed_workload(vocab)
        start_from(engine)
        want = engine.generate(reqs)
        warm = engine.generate([reqs[i] for i in perm])
        with pytest.raises(BitwiseMismatch):
            assert_same_completions(warm, want, lhs="arrival order, warm", rhs="original order")


def test_c5_arrival_order_failure_states_both_sides(qwen3):
    """A defect above 8 co-resident requests (bug_above_8_requests) reordered into other slots: the
    message carries each side's state and trace."""
    with ReferenceEngine(qwen3.path) as engine, FAULTS["bug_above_8_requests"].active(engine) as faulty:
        with pytest.raises(BitwiseMismatch) as err:
            _arrival_order(faulty, qwen3.config.vocab_size, list(range(10))[::-1])
    text = str(err.value)
    assert "state arrival order [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]: started cold (prefix cache reset)" in text, text
    assert "state default: started cold (prefix cache reset)" in text and "cached prompt tokens" in text, text
