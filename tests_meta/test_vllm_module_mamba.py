"""The module-built trainer's Mamba-2 mixer (#47 item 2) on the CPU stand-ins: vLLM 0.26's
MambaMixer2 (fixtures.vllm.fake_modules: its constructor and attributes, a causal_conv1d_fn
stand-in, the SSD scan twin as its chunk scan) wrapped by fixtures.vllm.module_wrap's REGISTRY
entry (fixtures.vllm.module_mamba).

Checked: the wrapped forward (in_proj, causal_conv1d_fn per sequence, one unsplit chunk scan with
the chunk metadata from each sequence's start, the gated norm, out_proj) is the unwrapped module's
bits on packed sequences that cross chunk boundaries (chunk size 8), and packed is each sequence
alone; the backward (every parameter: in_proj, conv1d weight / bias, A_log, D, dt_bias, norm,
out_proj, and the input) is within C8's bound of float64 autograd of the module, and a planted
reference (the D skip detached) is not; a planted wrapper fault - chunks counted from the packed
offset, as vLLM's compute_varlen_chunk_metadata does, instead of each sequence's start - is seen
in the bits; the trainer holds A_log (A = -exp(A_log.float()), the loader's lambda) and exports
the checkpoint's A_log bit for bit. What only a GPU can tell (vLLM's own kernels, its exp) is not
claimed here (docs/any-architecture.md)."""
from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn as nn

from fixtures.core.comparison import assert_bitwise
from fixtures.checks import declared_mamba as DM
from fixtures.checks.declared_ops import DECLARED_OPS, PLANTED_REFERENCES
from fixtures.vllm import fake_modules as V
from fixtures.vllm import module_mamba as MM
from fixtures.vllm import module_wrap as MW
from fixtures.vllm import weight_export as WE
from fixtures.vllm.module_trainer import PREFILL_REGISTRY, ModuleBuiltModel, ModuleBuiltTrainer
from test_vllm_module_wrap import Case, _judge, _run

Q = 8
LENS = [5, 13, 9, 8]             # packed offsets 0, 5, 18, 27: only the first on a chunk boundary
HID = 16
SHAPES = {"groups1": dict(n_groups=1, num_heads=4, head_dim=4, ssm_state_size=4),
          "groups2": dict(n_groups=2, num_heads=4, head_dim=4, ssm_state_size=3)}


def _mixer(shape: str, seed: int = 0, **kw) -> V.MambaMixer2:
    torch.manual_seed(seed)
    d = SHAPES[shape]
    m = V.MambaMixer2(HID, d["ssm_state_size"], 4, d["num_heads"] * d["head_dim"], True, False, n_groups=d["n_groups"],
                      num_heads=d["num_heads"], head_dim=d["head_dim"], model_config=V.MambaModelConfig(Q), **kw)
    with torch.no_grad():
        m.conv1d.bias.normal_(0, 0.3)
        m.D.normal_()
        m.dt_bias.normal_(0, 0.5)
        if m.norm.weight is not None:
            m.norm.weight.normal_(1, 0.1)
    return m


def _case(shape: str, dtype=torch.float32, lens=LENS, **kw) -> Case:
    m = _mixer(shape, **kw)
    A = m.A.detach().clone()
    case = Case(nn.Module(), lambda c, h: c.layer(h), list(lens))
    case.layer = m
    case = case.to(dtype)
    m.A.data = A                 # vLLM creates A in float32 whatever the model dtype
    m.lens = list(lens)
    return case


def _hidden(n: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HID, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _packed_offset_metadata(lens, chunk_size, device=None):
    """A planted fault: chunks counted from the packed offset (a boundary at every multiple of
    chunk_size of the packed row, and at each sequence start), as vLLM's exported
    compute_varlen_chunk_metadata counts them - valid metadata, other chunks."""
    cu, cu_chunk, seq_idx, last = [0], [], [], []
    for i, n in enumerate(lens):
        a, e = cu[-1], cu[-1] + n
        cuts = [a] + [p for p in range(a + 1, e) if p % chunk_size == 0]
        cu_chunk += cuts
        seq_idx += [i] * len(cuts)
        last.append(len(seq_idx) - 1)
        cu.append(e)
    cu_chunk.append(cu[-1])
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)     # noqa: E731
    return dict(cu_seqlens=t(cu), cu_chunk_seqlens=t(cu_chunk), seq_idx=t(seq_idx), last_chunk_indices=t(last))


REGISTRIES = {"module_wrap": MW.REGISTRY, "prefill": PREFILL_REGISTRY}


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("registry", sorted(REGISTRIES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_wrapped_forward_is_the_modules_bits_with_chunks_from_each_sequence_start(shape, registry, dtype, monkeypatch):
    monkeypatch.setattr(V.mamba_chunk_scan_combined_varlen, "calls", [])
    monkeypatch.setattr(V.causal_conv1d_fn, "calls", [])
    case = _case(shape, DTYPES[dtype])
    h = _hidden(sum(LENS), DTYPES[dtype])
    with torch.no_grad():
        want = copy.deepcopy(case)(h)
    w = MW.wrap_model(case, registry=REGISTRIES[registry]).require_known()
    assert w.wrapped == {"layer": "mamba_mixer2"}, w.wrapped
    assert "A_log" in dict(case.layer.named_parameters()) and "A" not in dict(case.layer.named_parameters())
    with torch.no_grad(), w.packed(LENS):
        got = case(h)
    assert_bitwise(got, want, what=f"MambaMixer2 ({shape}, {registry} wrapper) vs the module's own forward")
    scan = V.mamba_chunk_scan_combined_varlen.calls
    assert len(scan) == 2, "one unsplit chunk-scan call per packed batch (the module's, then the wrapper's)"
    mine = scan[-1]
    assert mine["cu_chunk_seqlens"].tolist() == [0, 5, 13, 18, 26, 27, 35]      # 8 rows from each start
    assert mine["seq_idx"].tolist() == [0, 1, 1, 2, 2, 3] and mine["last_chunk_indices"].tolist() == [0, 2, 4, 5]
    assert mine["initial_states"] is None and mine["chunk_size"] == Q
    conv = V.causal_conv1d_fn.calls[-1]
    assert conv["query_start_loc"] == [0, 5, 18, 27, 35] and conv["has_initial_state"] == [False] * 4


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_packed_is_each_sequence_alone(shape, dtype):
    """Under the reference batch-invariant kernels (planted: the stand-ins' stock CPU GEMMs round by
    row count differently under AVX2 and AVX-512, and the rule is about the wrapper's packing)."""
    from fixtures.reference.invariant_mode import batch_invariant_mode
    case = _case(shape, DTYPES[dtype])
    h = _hidden(sum(LENS), DTYPES[dtype])
    w = MW.wrap_model(case).require_known()
    with torch.no_grad(), batch_invariant_mode(), w.packed(LENS):
        packed = case(h)
    start = 0
    for i, n in enumerate(LENS):
        with torch.no_grad(), batch_invariant_mode(), w.packed([n]):
            alone = case(h[start:start + n])
        assert_bitwise(packed[start:start + n], alone, what=f"sequence {i} packed vs alone")
        start += n


def test_chunks_counted_from_the_packed_offset_are_seen_in_the_bits(monkeypatch):
    """Negative control of the forward: the wrapper's chunk metadata counted from the packed
    offset (sequences 1-3 do not start on a multiple of 8) gives other bits than the module's.
    In a float32 model: the CPU twin scans in float32, and at these sizes the other chunking's
    float32 rounding does not survive a bf16 output (measured: equal bits in bf16, 9.5e-7 apart
    in float32) - vLLM's kernel, with bf16 operands inside, is not claimed either way here."""
    case = _case("groups2", torch.float32)
    h = _hidden(sum(LENS), torch.float32)
    with torch.no_grad():
        want = copy.deepcopy(case)(h)
    w = MW.wrap_model(case).require_known()
    monkeypatch.setattr(MM, "mamba_prefill_metadata", _packed_offset_metadata)
    with torch.no_grad(), w.packed(LENS):
        got = case(h)
    differs = (got != want).any(-1)
    assert bool(differs.any()), "the planted chunking gave the module's bits: the test cannot see it"
    assert not bool(differs[:LENS[0]].any()), "the first sequence starts at offset 0: its chunks are the same"


def _grads(shape, references=None):
    case = _case(shape)
    MM.adopt_a_log(case.layer)          # the trainer's parameter in every copy, so the gradients share names
    h = [_hidden(sum(LENS))]
    plain32, plain64 = copy.deepcopy(case), copy.deepcopy(case).double()
    wrapped = MW.wrap_model(case, references=references).require_known()
    _, got = _run(case, h, wrapped=wrapped)
    _, g32 = _run(plain32, h)
    _, g64 = _run(plain64, [x.double() for x in h])
    return got, _judge(f"MambaMixer2 {shape}", got, g32, g64), wrapped


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_wrapped_backward_is_within_the_c8_bound_of_float64_autograd(shape):
    got, bad, wrapped = _grads(shape)
    assert not bad, "\n".join(bad)
    params = {f"layer.{n}" for n in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                                     "norm.weight", "out_proj.weight")}
    assert params <= set(got) and all(float(got[p].abs().max()) > 0 for p in params), sorted(got)
    assert set(wrapped.backward_references()) == {"mamba_mixer2", "token_logprobs"}


def test_a_planted_reference_is_caught_by_the_bound():
    """C8's planted slip of the op (fixtures.checks.declared_mamba: the D skip detached) fails the
    model-level bound on the wrapped mixer too (C8's op-level checks: test_declared_backwards.py)."""
    p = PLANTED_REFERENCES["mamba_mixer2"]
    assert p.fn is DM.mamba_skip_detached and DECLARED_OPS["mamba_mixer2"].define is DM.def_mamba
    _, bad, wrapped = _grads("groups2", references={"mamba_mixer2": p.fn})
    assert bad, f"{p.name}: the planted reference passed the bound"
    assert wrapped.backward_references()["mamba_mixer2"] is p.fn


def test_a_log_is_the_trained_parameter_and_gives_the_loaders_a():
    """adopt_a_log: A_log replaces A among the parameters; from the checkpoint's tensor (bf16
    here) its bits are kept and -exp(A_log.float()) is the module's A bit for bit; without it, a
    recovered float32 a with the same A; a tensor that does not give A is refused."""
    ckpt = torch.log(torch.linspace(1.0, 16.0, 4)).to(torch.bfloat16)
    m = _mixer("groups1")
    m.A.data = -torch.exp(ckpt.float())                     # what vLLM's loader stores
    A = m.A.detach().clone()
    with pytest.raises(ValueError, match="not the module's A bit for bit"):
        MM.adopt_a_log(copy.deepcopy(m), ckpt.float() + 1e-3)
    rec = MM.adopt_a_log(copy.deepcopy(m))
    assert_bitwise(-torch.exp(rec.A_log.float()), A, what="-exp(recovered A_log) vs A")
    MM.adopt_a_log(m, ckpt)
    assert "A" not in dict(m.named_parameters()) and m.A_log.dtype == torch.bfloat16
    assert_bitwise(m.A_log.detach(), ckpt, what="adopted A_log vs the checkpoint's")
    assert_bitwise(-torch.exp(m.A_log.float()), A, what="the trainer's A vs the loader's")


def test_an_unsupported_mixer_is_na_naming_the_attribute():
    case = _case("groups1", use_rms_norm=False)
    w = MW.wrap_model(case)
    assert "use_rms_norm False" in (w.na_reason() or ""), w.na_reason()


# ---------------------------------------------------------------------------------------------
# a tiny mamba2-shaped model through the module-built trainer: train step, export round trip
# ---------------------------------------------------------------------------------------------
class _Mamba2Model(nn.Module):
    """vLLM's Mamba2ForCausalLM's names at one layer: backbone.embeddings, backbone.layers.0.norm,
    backbone.layers.0.mixer, backbone.norm_f, lm_head (untied here), logits_processor."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.embeddings = V.VocabParallelEmbedding(vocab, HID)
        layer = nn.Module()
        layer.norm, layer.mixer = V.RMSNorm(HID), _mixer("groups2")
        self.backbone.layers = nn.ModuleList([layer])
        self.backbone.norm_f = V.RMSNorm(HID)
        self.lm_head, self.logits_processor = V.ParallelLMHead(vocab, HID), V.LogitsProcessor(vocab)

    def forward(self, input_ids, positions):
        h = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            h = h + layer.mixer(layer.norm(h))
        return self.backbone.norm_f(h)

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)


def _checkpoint(vocab: int = 50) -> dict:
    """A mamba2 checkpoint for _Mamba2Model (transformers' names, bf16 A_log)."""
    m = _Mamba2Model(vocab)
    g = torch.Generator().manual_seed(5)
    ck = {}
    for n, p in m.named_parameters():
        cname = n[:-2] + ".A_log" if n.endswith(".A") else n
        t = torch.randn(p.shape, generator=g) * 0.3
        if n.endswith(".A"):
            t = torch.log(1 + 7 * torch.rand(p.shape, generator=g))
        ck[cname] = (t[:vocab] if n.endswith(WE.VOCAB_PADDED) else t).to(torch.bfloat16)
    return ck


def test_the_module_built_trainer_trains_a_log_and_exports_the_checkpoints_bits():
    """The checkpoint loaded as vLLM does (A = -exp(A_log.float()), engine form), adopted with its
    A_log; export_weights is the checkpoint bit for bit; a train step gives every mixer parameter
    a gradient and moves A_log, whose export the engine turns into A = -exp(A_log.float())."""
    ck = _checkpoint()
    model = _Mamba2Model().to(torch.bfloat16)
    engine = WE.stack_checkpoint(ck, "mamba2")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.data = engine[n].clone() if n.endswith(".A") else engine[n].to(p.dtype).clone()
    MM.adopt_a_log(model.backbone.layers[0].mixer, ck["backbone.layers.0.mixer.A_log"])
    built = ModuleBuiltModel.from_model(model, types.SimpleNamespace(model_type="mamba2", vocab_size=50))
    assert built.wrapped.wrapped["backbone.layers.0.mixer"] == "mamba_mixer2"
    trainer = ModuleBuiltTrainer(built, lr=1.0)       # a step that moves bf16 weights
    out = trainer.export_weights()
    assert sorted(out) == sorted(ck)
    for n in ck:
        assert_bitwise(out[n], ck[n], what=f"exported {n} vs the checkpoint's")
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    trainer.train_step(seqs, prompt_lens=[2, 3], advantages=[1.0, -0.5])
    grads = trainer.export_gradients()
    for n in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
        assert float(grads[f"backbone.layers.0.mixer.{n}"].float().abs().max()) > 0, n
    new = trainer.export_weights()["backbone.layers.0.mixer.A_log"]
    assert not torch.equal(new, ck["backbone.layers.0.mixer.A_log"]), "A_log did not train"
    reloaded = WE.stack_checkpoint({"backbone.layers.0.mixer.A_log": new}, "mamba2")["backbone.layers.0.mixer.A"]
    assert_bitwise(reloaded, -torch.exp(model.backbone.layers[0].mixer.A_log.detach().float()),
                   what="the engine's A after a reload vs the trainer's forward A")
