"""C7 / C9 at rollout scale on the CPU: the trainer packs a rollout into token-bounded
micro-batches, the check reports the shapes it compared, and a fault that only fires from 256 rows
(a norm re-rounding, as vLLM 0.26's fused add + RMSNorm does) is green at the 4-prompt toy batch,
red at a rollout-sized one, and localised at the failing shapes - named as the norm - where the
old localisation (one sequence alone on both sides) saw every module equal."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import EngineStats, Layout
from fixtures.checks.rollouts import assert_parity, localise_at_shapes, sample_rollouts
from fixtures.checks.workloads import PARITY_CPU, ParityWorkload, pack_micro_batches, parity_workload
from fixtures.faults.catalog import FAULTS
from fixtures.faults.variants import fused_norm_rerounds_from
from fixtures.models.proxies import build_proxy
from fixtures.plugin.options import trainer_micro_batch_tokens

# a rollout past 256 tokens per micro-batch that stays a few seconds on the CPU
SCALE = ParityWorkload(prompts=8, n=2, prompt_lengths=(24, 48), max_tokens=(4, 8), micro_batch_tokens=512)


def test_packing_is_in_order_and_bounded():
    assert pack_micro_batches([5, 5, 10, 3, 2], 10) == [[0, 1], [2], [3, 4]]
    assert pack_micro_batches([12, 3], 10) == [[0], [1]]          # a longer sequence goes alone
    assert pack_micro_batches([4, 4], None) == [[0, 1]]
    assert parity_workload("cpu") is PARITY_CPU and parity_workload("cuda").prompts >= 128


def test_gpu_workload_reaches_the_switch_sizes():
    """The GPU default must put trainer micro-batches past 256 and 1024 tokens (ids drawn, not run)."""
    w = parity_workload("cuda")
    rs = w.requests(1000, seed=1)
    lengths = [len(r.prompt_ids) + r.params.max_tokens for r in rs for _ in range(r.params.n)]
    sizes = [sum(lengths[k] for k in mb) for mb in pack_micro_batches(lengths, w.micro_batch_tokens)]
    assert len(lengths) >= 256 and min(sizes[:-1]) > 1024, sizes


@pytest.mark.parametrize("raw, expect", [(None, None), ("300", 300), (" 2 ", 2), ("1", "error"), ("0", "error"),
                                         ("-5", "error"), ("lots", "error")])
def test_micro_batch_option_is_validated(raw, expect):
    config = SimpleNamespace(getoption=lambda name, default=None: raw)
    if expect == "error":
        with pytest.raises(pytest.UsageError, match="--trainer-micro-batch-tokens"):
            trainer_micro_batch_tokens(config)
    else:
        assert trainer_micro_batch_tokens(config) == expect


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from fixtures.reference.implementation import ReferenceImplementation
    impl = ReferenceImplementation()
    path = build_proxy("qwen3", "tiny", tmp_path_factory.mktemp("qwen3")).path
    engine, trainer = impl.make_engine(path), impl.make_trainer(path)
    yield engine, trainer, path
    engine.close()
    trainer.close()


def test_shapes_are_reported_as_metrics(pair):
    engine, trainer, _ = pair
    rs = sample_rollouts(engine, SCALE.requests(trainer.module().config.vocab_size, seed=1))
    got = {}
    assert_parity(engine, trainer, rs, layout=Layout.PACKED, micro_batch_tokens=SCALE.micro_batch_tokens,
                  record=got.__setitem__)
    assert got["tokens"] == sum(len(r.token_ids) for r in rs) and got["sequences"] == 16
    assert got["trainer_micro_batches"] >= 2 and got["trainer_micro_batch_tokens_max"] <= 512
    assert got["trainer_micro_batches_ge_256"] >= 1 and got["trainer_micro_batch_sequences_max"] > 1
    assert got["engine_rollout_steps"] > 0 and got["engine_rollout_step_tokens_max"] > 256


def test_norm_switching_at_256_rows_is_caught_at_scale_and_named(pair):
    """trainer_norm_blocks_256_layer1 (layer 1's RMSNorm mean in 4 blocks from 256 rows): the toy
    C7 (8 sequences, ~230 tokens in one packed micro-batch) stays exact; the rollout-scale one goes
    red, and the localisation re-runs the trainer's failing micro-batch and names the norm."""
    engine, trainer, _ = pair
    fault = FAULTS["trainer_norm_blocks_256_layer1"]
    vocab = trainer.module().config.vocab_size
    toy = sample_rollouts(engine, PARITY_CPU.requests(vocab, seed=1))
    scale = sample_rollouts(engine, SCALE.requests(vocab, seed=1))
    assert sum(len(r.sequence) for r in toy) < 256
    with fault.active(trainer):
        assert_parity(engine, trainer, toy, layout=Layout.PACKED, micro_batch_tokens=PARITY_CPU.micro_batch_tokens)
        with pytest.raises(BitwiseMismatch) as err:
            assert_parity(engine, trainer, scale, layout=Layout.PACKED, micro_batch_tokens=SCALE.micro_batch_tokens)
    text = str(err.value)
    assert "trainer micro-batches (packed, <= 512 tokens each)" in text and "engine rollout steps:" in text, text
    assert "localised at the failing shapes" in text and "micro-batch of" in text, text
    assert fault.module in text and fault.op in text, text


# ---------------------------------------------------------------------------------------------
# module by module (vLLM + the engine-kernel trainer), with a stand-in engine
# ---------------------------------------------------------------------------------------------
def _reference_ops(config):
    from fixtures.vllm.trainer_ops import ReferenceOps
    return ReferenceOps(config)


# the plain-torch engine-layout ops, except the fused add + RMSNorm moves every 41st row one ULP
# up when a call has >= 256 rows: a launch switch at 256 tokens
_NormReroundsFrom256Rows = fused_norm_rerounds_from(_reference_ops, start=5, step=41,
                                                    name="reference-ops+norm-reround-from-256")


class _EngineOfTrainer:
    """An engine stand-in recording what vLLM's worker hooks would, from a clean engine-kernel
    trainer: module_outputs of one prefill alone, and record_rows of a request inside a prefill of
    the whole generate() batch (one packed step)."""
    module_naming = "vllm"

    def __init__(self, clean):
        self.clean, self._recording, self._stats = clean, None, EngineStats()

    def module_outputs(self, sequence):
        return list(self.clean.module_outputs(sequence).items())

    @contextlib.contextmanager
    def record_rows(self, request_id):
        from fixtures.diagnose.engine_rows import EngineRows
        rows = EngineRows(request_id)
        self._recording = rows
        try:
            yield rows
        finally:
            self._recording = None

    def generate(self, requests):
        seqs = [list(r.prompt_ids) for r in requests]
        rows = self._recording
        index = [r.request_id for r in requests].index(rows.request_id)
        for name, t in self.clean.module_outputs_in_batch(seqs, index).items():
            for p in range(t.shape[0]):
                rows.add(p, name, "Module", t[p])
        self._stats = EngineStats(steps=1, step_tokens=[sum(len(s) for s in seqs)])
        return []

    def last_stats(self):
        return self._stats


def test_module_level_localisation_reproduces_the_micro_batch(pair):
    """Alone, engine and trainer agree at every module (what the old localisation reported); in
    the failing micro-batch (300+ tokens) against the engine's batch, the norm is named."""
    from fixtures.vllm import trainer as VT
    from fixtures.vllm.trainer_ops import ReferenceOps
    _, _, path = pair
    clean = VT.EngineKernelTrainer(path, ReferenceOps, dtype=torch.float32, device="cpu")
    faulty = VT.EngineKernelTrainer(path, _NormReroundsFrom256Rows, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(4)
    vocab = clean.module().config.vocab_size
    batch = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 120, 90, 70)]
    text = localise_at_shapes(_EngineOfTrainer(clean), faulty, batch, 1, Layout.PACKED)
    first = text.splitlines()[1]
    assert first.startswith("engine in its batch vs trainer in its micro-batch: first diverging module output: "
                            "model.layers.0.post_attention_layernorm"), text
    assert "alone (one sequence each side): all" in text and "equal" in text, text
    assert "micro-batch of 4 sequences / 320 tokens" in text, text
