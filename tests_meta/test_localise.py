"""The first-diverging-op localisation (fixtures.diagnose.localise) on tiny proxies.

THE DEMONSTRATION: a llama tiny proxy runs one request alone and the same request as row 5 of a
64-row batch, under the batch-invariant mode (stock fp32 CPU GEMM is batch-variant from 2 rows,
so without it every run would part at the first matmul). With a variant matmul planted in layer 1
(split-K from 64 rows) the localisation names model.layers.1.self_attn.q_proj / aten.mm; with a
variant norm planted there (reduction blocks change at 256 tokens) it names
model.layers.1.input_layernorm / aten.mean - and nothing diverges without a fault.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch, assert_bitwise
from fixtures.faults.catalog import FAULTS
from fixtures.faults.stock_variance import ShapeVariantStockGEMM
from fixtures.faults.variants import blocked_mean, split_k_mm
from fixtures.diagnose.localise import Rows, localise
from fixtures.models.proxies import build_proxy, load_model

aten = torch.ops.aten

try:
    from fixtures.reference.invariant_mode import batch_invariant_mode
except ImportError:  # pragma: no cover - the mode is part of the suite; this keeps the demo alive without it
    from torch.utils._python_dispatch import TorchDispatchMode

    class _RowwiseMM(TorchDispatchMode):
        """Minimal invariant matmul: every row is its own M=1 GEMM, whatever the batch."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default and args[0].shape[0] > 1:
                a, b = args
                return torch.cat([func(a[i:i + 1], b) for i in range(a.shape[0])])
            return func(*args, **(kwargs or {}))

    def batch_invariant_mode():
        return _RowwiseMM()

T = 7            # tokens per row: differs from every width of the tiny proxies (16, 32, 64, ...)
NEEDLE = 5


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_proxy("llama", "tiny", tmp_path_factory.mktemp("llama")).path


@pytest.fixture(scope="module")
def llama(llama_dir):
    return load_model(llama_dir)


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 512, (64, T), generator=torch.Generator().manual_seed(0))


def forward(model, ids, *, invariant=True, **kw):
    def run():
        with torch.no_grad(), (batch_invariant_mode() if invariant else contextlib.nullcontext()):
            return model(input_ids=ids, use_cache=False, **kw).logits
    return run


def needle_vs_batch(model, batch, **kw):
    one = batch[NEEDLE:NEEDLE + 1]
    return localise(forward(model, one, **kw), forward(model, batch, **kw), model,
                    Rows.row(0), Rows.row(NEEDLE), names=("alone", f"row {NEEDLE} of 64"))


# ---------------------------------------------------------------------------------------------
# the demonstration
# ---------------------------------------------------------------------------------------------
def test_no_divergence_without_a_fault(llama, batch):
    """The baseline that makes the demonstration mean something: under the invariant mode the
    needle alone and inside the batch run the same bits through every op."""
    loc = needle_vs_batch(llama, batch)
    assert loc is None, loc.describe()


@pytest.mark.parametrize("name, module, op", [
    ("trainer_linear_split_k_layer1", "model.layers.1.self_attn.q_proj", "aten.mm"),
    ("trainer_norm_blocks_256_layer1", "model.layers.1.input_layernorm", "aten.mean"),
])
def test_demonstration_names_the_planted_op(llama, batch, name, module, op):
    fault = FAULTS[name]
    assert (fault.module, fault.op) == (module, op), "the registry and the demonstration disagree"
    with fault.active(llama):
        alone = forward(llama, batch[NEEDLE:NEEDLE + 1])()[0]
        inside = forward(llama, batch)()[NEEDLE]
        loc = needle_vs_batch(llama, batch)
        assert loc is not None, f"{name} planted but nothing diverged"
        assert loc.kind == "values" and (loc.module, loc.op) == (module, op), loc.describe()
        assert loc.values.differing > 0 and loc.values.max_ulp > 0 and loc.values.row
        assert loc.values.a_hex != loc.values.b_hex and loc.values.a_hex.startswith("0x")
        # as a gate's failure message shows it
        with pytest.raises(BitwiseMismatch) as err:
            assert_bitwise(alone.log_softmax(-1), inside.log_softmax(-1), what="needle logprobs",
                           lhs_name="alone", rhs_name="in batch", localise=loc.describe)
    msg = str(err.value)
    assert f"first diverging op: {module}: {op}" in msg, msg


_EXACT_VARIANTS = {   # name: (the planted variant at `rows` rows, the stock op it replaces)
    "blocked_mean": (lambda x: blocked_mean(aten.mean.dim, (x, [-1], True), {}, min_rows=256),
                     lambda x: x.mean(-1, keepdim=True)),
    "split_k_mm": (lambda x: split_k_mm(aten.mm.default, (x, torch.eye(x.shape[1])), {}, min_rows=256),
                   lambda x: torch.mm(x, torch.eye(x.shape[1]))),
}


@pytest.mark.parametrize("name", sorted(_EXACT_VARIANTS))
def test_a_planted_variant_moves_every_row_it_touches(name):
    """Rows whose reordered sum is exact (all ones, an identity GEMM) round alike in any order - as
    some rows of real data do under some CPU's stock order: the plant still moves each of them, so
    a fault fires on every CPU (a CI machine once saw a blocked mean agree on every needle token);
    below its threshold it is the stock op, bit for bit."""
    variant, stock = _EXACT_VARIANTS[name]
    x = torch.ones(300, 64)
    out = variant(x)
    assert out.shape == stock(x).shape
    assert bool((out != stock(x)).any(-1).all()), "a row of the planted variant rounded like the stock op"
    below = torch.ones(255, 64)
    assert torch.equal(variant(below), stock(below))


def test_stock_gemm_control_diverges_at_the_first_matmul(llama, batch):
    """Without the invariant mode a stock GEMM may round a row by the call's row count: MKL does on
    some CPUs and not on others, so the variance is planted (ShapeVariantStockGEMM) and the control
    fires on every CPU; the first op to part is then the first projection."""
    with ShapeVariantStockGEMM():
        loc = needle_vs_batch(llama, batch, invariant=False)
    assert loc is not None, "the planted shape-variant GEMM did not move the needle's row"
    assert (loc.module, loc.op) == ("model.layers.0.self_attn.q_proj", "aten.mm"), loc.describe()


# ---------------------------------------------------------------------------------------------
# structure, row selection, reruns, timing
# ---------------------------------------------------------------------------------------------
def test_rerun_without_fault_returns_none(llama, batch):
    run = forward(llama, batch)
    assert localise(run, run, llama, Rows.row(NEEDLE), Rows.row(NEEDLE)) is None


@contextlib.contextmanager
def extra_op(module, factor: float):
    h = module.register_forward_hook(lambda _m, _a, out: out * factor)
    try:
        yield
    finally:
        h.remove()


def run_with_extra_op(model, ids, factor):
    def run():
        with extra_op(model.model.layers[1].mlp, factor):
            return forward(model, ids)()
    return run


def test_structural_divergence_names_the_extra_op(llama, batch):
    """Side B runs one more op (a value-preserving * 1.0 in a forward hook of layer 1's MLP, i.e.
    in layer 1 after the MLP returned): the op sequences part there, and no value differs."""
    ids = batch[:2]
    loc = localise(forward(llama, ids), run_with_extra_op(llama, ids, 1.0), llama, Rows.row(1), Rows.row(1))
    assert loc is not None and loc.kind == "structure", loc
    assert loc.values is None
    assert loc.structure.only_a == [] and loc.structure.only_b[0] == ("model.layers.1", "aten.mul"), loc.describe()
    assert "op sequences part" in loc.describe() and "B runs model.layers.1: aten.mul" in loc.describe()


def test_structural_divergence_comes_before_the_values_it_changes(llama, batch):
    """An extra op that changes values: the headline is the first aligned op whose outputs differ
    (the residual add consuming the scaled MLP output), and the op sequences are seen to part
    just before it, at the extra op."""
    ids = batch[:2]
    loc = localise(forward(llama, ids), run_with_extra_op(llama, ids, 1.5), llama, Rows.row(0), Rows.row(0))
    assert loc.kind == "values" and loc.structure is not None, loc
    assert (loc.structure.module, loc.structure.op) == ("model.layers.1", "aten.mul"), loc.describe()
    assert loc.values.index_b > loc.structure.index_b and loc.values.module == "model.layers.1", loc.describe()
    assert "earlier, op sequences part" in loc.describe()


def test_different_row_counts_and_positions(llama, batch):
    """Side A: the needle as row 1 of a 2-row batch; side B: row 5 of 64. Rows select the same
    request on both sides whatever the batch (and the flattened GEMM rows, bmm's batch*heads)."""
    two = torch.stack([batch[0], batch[NEEDLE]])
    a, b = forward(llama, two), forward(llama, batch)
    assert localise(a, b, llama, Rows.row(1), Rows.row(NEEDLE)) is None
    with FAULTS["trainer_linear_split_k_layer1"].active(llama):
        loc = localise(a, b, llama, Rows.row(1), Rows.row(NEEDLE))
    assert (loc.module, loc.op) == ("model.layers.1.self_attn.q_proj", "aten.mm"), loc
    assert loc.values.shape_a == (2 * T, 64) and loc.values.shape_b == (64 * T, 64)
    assert loc.values.selected == (T, 64)
    # the wrong rows are seen to differ (row 0 of A is another request)
    wrong = localise(a, b, llama, Rows.row(0), Rows.row(NEEDLE))
    assert wrong is not None and wrong.op == "aten.embedding", wrong


def packed(batch, rows):
    seqs = [batch[i] for i in rows]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, pos


def test_packed_tokens_selected_by_span(llama, batch):
    """Side B packs sequences into one row (positions restart per sequence); Rows.span selects the
    needle's tokens, and its attention keys, inside the pack. The sides differ only in how the
    positions were made (computed for A, given for B): a structural note, no value differs."""
    alone = forward(llama, batch[NEEDLE:NEEDLE + 1])
    ids, pos = packed(batch, [1, NEEDLE, 2])                   # 21 tokens; the needle at 7..13
    loc = localise(alone, forward(llama, ids, position_ids=pos), llama, Rows.row(0), Rows.span(T, T))
    assert loc is not None and loc.values is None and not loc.incomparable, loc.describe()
    assert loc.structure.only_a[0] == ("model", "aten.arange"), loc.describe()
    with FAULTS["trainer_linear_split_k_layer1"].active(llama):
        ids, pos = packed(batch, range(10))                   # 70 tokens >= 64: split-K
        loc = localise(alone, forward(llama, ids, position_ids=pos), llama, Rows.row(0),
                       Rows.span(NEEDLE * T, T))
    assert (loc.module, loc.op) == ("model.layers.1.self_attn.q_proj", "aten.mm"), loc.describe()


def test_prefill_vs_decode_step(llama, batch):
    """Prefill of n+1 tokens, last token, vs the decode step (forward #1) of the same token after a
    prefill of n: every comparable op agrees under the invariant mode (the KV cache concatenation
    is not comparable by rows and is listed as such)."""
    ids = batch[NEEDLE:NEEDLE + 1]
    n = T - 1

    def prefill():
        with torch.no_grad(), batch_invariant_mode():
            return llama(input_ids=ids, use_cache=True).logits

    def decode():
        with torch.no_grad(), batch_invariant_mode():
            out = llama(input_ids=ids[:, :n], use_cache=True)
            return llama(input_ids=ids[:, n:], past_key_values=out.past_key_values, use_cache=True).logits

    loc = localise(prefill, decode, llama, Rows.token(n), Rows.token(0, call=1))
    assert loc is None or loc.values is None, loc.describe()
    with FAULTS["trainer_linear_split_k_layer1"].active(llama):   # M = 7 and 1: below the threshold
        loc2 = localise(prefill, decode, llama, Rows.token(n), Rows.token(0, call=1))
    assert loc2 is None or loc2.values is None, loc2.describe()


def test_localising_a_tiny_proxy_takes_seconds(llama, batch, record_property):
    t0 = time.perf_counter()
    with FAULTS["trainer_norm_blocks_256_layer1"].active(llama):
        loc = needle_vs_batch(llama, batch)
    took = time.perf_counter() - t0
    record_property("localise_seconds", round(took, 2))
    assert loc is not None and loc.seconds <= took
    assert took < 30, f"localising a tiny proxy forward (1 vs 64 rows) took {took:.1f}s"


# ---------------------------------------------------------------------------------------------
# the other module-level faults, as a gate would localise them
# ---------------------------------------------------------------------------------------------
def test_moe_batch_activation_scale_is_named(tmp_path_factory):
    fault = FAULTS["moe_batch_activation_scale"]
    model = load_model(build_proxy(fault.model, "tiny", tmp_path_factory.mktemp("moe")).path)
    ids = torch.randint(0, model.config.vocab_size, (16, T), generator=torch.Generator().manual_seed(1))
    one = ids[3:4]
    clean = localise(forward(model, one), forward(model, ids), model, Rows.row(0), Rows.row(3))
    assert clean is None or clean.values is None, clean.describe()   # expert loops may differ in structure
    with fault.active(model):
        loc = localise(forward(model, one), forward(model, ids), model, Rows.row(0), Rows.row(3))
    assert loc is not None and loc.values is not None, loc
    assert (loc.values.module, loc.values.op) == (fault.module, fault.op), loc.describe()
    assert not loc.values.row, "the batch-wide scale is a non-row output, compared whole"


def test_trainer_vs_engine_with_other_gemm_tiling(llama_dir, llama, batch):
    """The C7-only fault: two model objects, each batch-invariant, the trainer's GEMMs split in K."""
    fault = FAULTS["trainer_gemm_tiling"]
    trainer_model = load_model(llama_dir)
    ids = batch[:3]
    with fault.active(trainer_model):
        assert localise(forward(trainer_model, ids[:1]), forward(trainer_model, ids), trainer_model,
                        Rows.row(0), Rows.row(0)) is None, "the tiled trainer must itself be batch-invariant"
        loc = localise(forward(llama, ids), forward(trainer_model, ids), llama, Rows.row(2), Rows.row(2),
                       model_b=trainer_model, names=("engine", "trainer"))
    assert (loc.module, loc.op) == (fault.module, fault.op), loc.describe()


def test_trainer_log_softmax_precision_is_named(llama_dir):
    from fixtures.reference.hf_trainer import HFTrainer
    fault = FAULTS["trainer_log_softmax_fp64"]
    plain = HFTrainer(llama_dir, kernel_mode=batch_invariant_mode)
    faulty = fault.wrap_trainer(HFTrainer(llama_dir, kernel_mode=batch_invariant_mode))
    seqs = [[3, 14, 15, 92, 65, 35, 89, 79]]
    loc = localise(lambda: plain.logprobs(seqs), lambda: faulty.logprobs(seqs), plain.module(),
                   model_b=faulty.module(), names=("engine-like", "trainer"))
    assert loc is not None and (loc.module, loc.op) == (fault.module, fault.op), loc and loc.describe()


@pytest.mark.parametrize("name", ["matmul_split_k_rows", "rms_norm_blocks_256"])
def test_kernel_variant_is_named_where_the_model_first_uses_it(llama, batch, name):
    """A variant kernel swapped into fixtures.reference.kernels.KERNELS (served by the invariant mode) is
    named at its first use in the model: 448 rows cross both thresholds (64 rows, 256 tokens)."""
    fault = FAULTS[name]
    with fault.active():
        loc = needle_vs_batch(llama, batch)
    assert loc is not None and (loc.module, loc.op) == (fault.module, fault.op), loc and loc.describe()


def test_split_kv_decode_attention_is_named_prefill_vs_decode(llama_dir, batch):
    fault = FAULTS["attention_split_kv_decode"]
    model = load_model(llama_dir, attn_implementation="sdpa")
    ids, n = batch[NEEDLE:NEEDLE + 1], T - 1

    def prefill():
        with torch.no_grad(), batch_invariant_mode():
            return model(input_ids=ids, use_cache=True).logits

    def decode():
        with torch.no_grad(), batch_invariant_mode():
            out = model(input_ids=ids[:, :n], use_cache=True)
            return model(input_ids=ids[:, n:], past_key_values=out.past_key_values, use_cache=True).logits

    assert localise(prefill, decode, model, Rows.token(n), Rows.token(0, call=1)) is None
    with fault.active():
        loc = localise(prefill, decode, model, Rows.token(n), Rows.token(0, call=1))
    assert loc is not None and (loc.module, loc.op) == (fault.module, fault.op), loc and loc.describe()


def test_engine_rows_name_the_module_where_a_batch_changes_a_request(tmp_path):
    """C3's engine-side localisation: a request alone vs inside a batch, module output rows of its
    tokens compared in call order. Clean engine: nothing differs; with the planted batch-wide MoE
    activation scale, the experts module is named (the fault's module)."""
    from fixtures.core.contract import Request, SamplingParams
    from fixtures.diagnose.engine_rows import localise_in_engine
    from fixtures.models.proxies import build_proxy
    from fixtures.reference.engine import ReferenceEngine
    spec = build_proxy("qwen3_moe", "tiny", tmp_path / "moe", seed=0)
    engine = ReferenceEngine(spec.path)
    needle = Request("needle", (5, 9, 200, 31, 7), SamplingParams(max_tokens=3))
    batch = [Request("o1", (44, 45, 46), SamplingParams(max_tokens=2)), needle,
             Request("o2", tuple(range(100, 121)), SamplingParams(max_tokens=2))]
    clean = localise_in_engine(engine, needle, batch, 1)
    assert clean.startswith("all ") and "bitwise equal alone and in the batch" in clean, clean
    fault = FAULTS["moe_batch_activation_scale"]
    with fault.active(engine):
        found = localise_in_engine(engine, needle, batch, 1)
    assert f"{fault.module} (" in found and "output elements differ" in found and "ULP" in found, found
    assert f"first diverging op inside {fault.module}" in found and f"{fault.module}: {fault.op} -> []" in found, found
    twice = batch + [Request("o3", needle.prompt_ids, SamplingParams(max_tokens=3))]   # the prompt repeated
    with fault.active(engine):
        ambiguous = localise_in_engine(engine, needle, twice, 1)
    assert f"{fault.module} (" in ambiguous and "ambiguous" in ambiguous and fault.op not in ambiguous, ambiguous


def test_logprob_step_named_after_equal_logits(llama_dir):
    """C7's localisation when the model is not where trainer and engine part: the engine's
    log-softmax runs over every prefill position ([n, V]), the trainer's over its shifted logits
    ([1, n - 1, V]); with equal logits, the logprob step is compared on the positions both have
    and the planted float64 log-softmax is named with its position and vocabulary id. Clean: the
    logits are equal and no op of the step differs."""
    from fixtures.diagnose.localise import record
    from fixtures.diagnose.logprob_step import describe_logprob_step, localise_logprob_step, logits_compared
    from fixtures.reference.engine import ReferenceEngine
    from fixtures.reference.hf_trainer import HFTrainer
    fault = FAULTS["trainer_log_softmax_fp64"]
    engine = ReferenceEngine(llama_dir, kernel_mode=batch_invariant_mode)
    seq = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    rec_e = record(lambda: engine.prompt_logprobs([seq]), engine.module(), Rows.row(0, len(seq)))
    for trainer, planted in ((HFTrainer(llama_dir, kernel_mode=batch_invariant_mode, attn_implementation="invariant"),
                              False),
                             (fault.wrap_trainer(HFTrainer(llama_dir, kernel_mode=batch_invariant_mode,
                                                           attn_implementation="invariant")), True)):
        rec_t = record(lambda: trainer.logprobs([seq]), trainer.module(), Rows.row(0, len(seq)))
        logits = logits_compared(rec_e, rec_t, ("engine", "trainer"))
        assert logits.equal and (logits.positions, logits.vocab) == (len(seq), 512), logits.detail
        loc = localise_logprob_step(rec_e, rec_t, logits, names=("engine", "trainer"))
        if not planted:
            assert loc is None, loc.describe()
            continue
        assert loc is not None and (loc.module, loc.op) == (fault.module, fault.op), loc and loc.describe()
        text = describe_logprob_step(loc, logits, ("engine", "trainer"))
        assert f"positions 0..{len(seq) - 2} compared" in text and "vocabulary id" in text and "ULP" in text, text


def test_a_cold_rerun_that_does_not_reproduce_is_said(tmp_path):
    """The mechanism checks' localisation reruns both engines cold. Where the request's samples come
    out bit-identical on that rerun, it says the difference did not reproduce (nondeterminism, or a
    state a cold start lacks), never "the difference arises after the modules". Where they still
    differ with every module row equal - the control: a planted engine that reports temperature-
    scaled logprobs, a change after the modules - it says that."""
    from fixtures.core.contract import Request, SamplingParams
    from fixtures.diagnose.engine_rows import localise_across
    from fixtures.models.proxies import build_proxy
    from fixtures.reference.engine import ReferenceEngine
    spec = build_proxy("llama", "tiny", tmp_path / "m", seed=0)
    engine = ReferenceEngine(spec.path)
    batch = [Request("a", (5, 9, 200, 31), SamplingParams(max_tokens=3, temperature=0.7, seed=3)),
             Request("b", (44, 45, 46), SamplingParams(max_tokens=2))]
    same = localise_across([("first", engine), ("second", engine)], batch, "a")
    assert same.startswith("the difference did not reproduce: rerun cold"), same
    assert same.endswith("The reruns started first: cold (prefix cache reset); second: cold (prefix cache reset)"), same
    # the failing runs' completions given: the side whose first run the rerun does not give is named
    import dataclasses
    honest = next(c for c in engine.generate(list(batch)) if c.request_id == "a")
    moved = honest.samples[0].logprobs.clone()
    moved.view(torch.int32)[0] += 1
    odd = dataclasses.replace(honest, samples=[dataclasses.replace(honest.samples[0], logprobs=moved)])
    told = localise_across([("first", engine), ("second", engine)], batch, "a", first=(honest, odd))
    assert ("; the rerun equals first's first run, not second's: second's first run depended on something "
            "its rerun lacked") in told, told
    told = localise_across([("first", engine), ("second", engine)], batch, "a", first=(honest, honest))
    assert "; each side's first run equals its rerun. The reruns started" in told, told
    planted = FAULTS["temperature_scaled_logprobs"].wrap_engine(engine)
    after = localise_across([("first", engine), ("planted", planted)], batch, "a")
    assert after.startswith("all ") and "the difference arises after them" in after, after
