"""The module-built trainer (fixtures.vllm.module_trainer.ModuleBuiltTrainer, #46) behind the
Trainer contract, on vLLM-shaped models built from the CPU stand-ins (fixtures.vllm.fake_modules):
its logprobs are the unwrapped model's bits; its backward is within C8's model bound of float64
autograd; a train step moves the weights and the export gives the checkpoint's names; an unknown
layer, an architecture without an export rule and the padded layout are n/a with their reason; one
forward enters vLLM's forward context once (a stand-in set_forward_context: vLLM is not here)."""
from __future__ import annotations

import contextlib
import copy
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from fixtures.checks.grad_bounds import U32
from fixtures.checks.grad_model import C_MODEL, FLOOR_U
from fixtures.core import contract as C
from fixtures.core.comparison import assert_bitwise
from fixtures.vllm import fake_modules as V
from fixtures.vllm import weight_export as WE
from fixtures.vllm.module_trainer import ModuleBuiltModel, ModuleBuiltTrainer

HID, HEADS, KV, HD, INTER, VOCAB, E, TOPK = 32, 4, 2, 8, 48, 100, 4, 2
SEQS = [[5, 17, 3, 99, 42, 8, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [60, 61, 62]]


def _norm(n):
    layer = V.RMSNorm(n)
    with torch.no_grad():
        layer.weight.normal_(1.0, 0.3)
    return layer


class Attn(nn.Module):
    """Qwen3Attention's layer order: merged QKV, per-head q/k norm, rotary, attention, o_proj."""

    def __init__(self):
        super().__init__()
        self.qkv_proj, self.o_proj = V.QKVParallelLinear(HID, HD, HEADS, KV), V.RowParallelLinear(HEADS * HD, HID)
        self.q_norm, self.k_norm = _norm(HD), _norm(HD)
        self.rotary_emb, self.attn = V.RotaryEmbedding(HD, HD, 256, 10000.0, True), V.Attention(HEADS, HD, HD ** -0.5, KV)

    def forward(self, positions, x):
        q, k, v = self.qkv_proj(x)[0].split([HEADS * HD, KV * HD, KV * HD], -1)
        q = self.q_norm(q.reshape(-1, HEADS, HD)).reshape(-1, HEADS * HD)
        k = self.k_norm(k.reshape(-1, KV, HD)).reshape(-1, KV * HD)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))[0]


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.act_fn = V.MergedColumnParallelLinear(HID, [INTER, INTER]), V.SiluAndMul()
        self.down_proj = V.RowParallelLinear(INTER, HID)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class Moe(nn.Module):
    """Qwen3MoeSparseMoeBlock over vLLM 0.26's FusedMoE module: the router GEMM inside the runner."""

    def __init__(self):
        super().__init__()
        self.gate = V.ReplicatedLinear(HID, E)
        self.experts = V.MoERunner(V.FusedTopKRouter(TOPK), V.RoutedExperts(E, HID, 12), gate=self.gate)

    def forward(self, x):
        return self.experts(x, x)


class Layer(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _norm(HID), _norm(HID)
        self.self_attn, self.mlp = Attn(), (Moe() if moe else Mlp())

    def forward(self, positions, h, residual):
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class Body(nn.Module):
    def __init__(self, moe_layers=()):
        super().__init__()
        self.embed_tokens = V.VocabParallelEmbedding(VOCAB, HID)
        self.layers = nn.ModuleList([Layer(i in moe_layers) for i in range(2)])
        self.norm = _norm(HID)


class TinyForCausalLM(nn.Module):
    """vLLM's *ForCausalLM interface and parameter names: forward(input_ids, positions) -> hidden,
    compute_logits(hidden); the packed lengths read off the positions (each sequence from 0), as
    the stand-in Attention needs them (vLLM's reads them from its attention metadata)."""

    def __init__(self, moe_layers=()):
        super().__init__()
        self.model = Body(moe_layers)
        self.lm_head, self.logits_processor = V.ParallelLMHead(VOCAB, HID), V.LogitsProcessor(VOCAB)
        self.on_forward = None

    def forward(self, input_ids, positions):
        if self.on_forward is not None:
            self.on_forward()
        starts = (positions == 0).nonzero().flatten().tolist() + [positions.numel()]
        lens = [b - a for a, b in zip(starts, starts[1:])]
        for layer in self.model.layers:
            layer.self_attn.attn.lens = lens
        h, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)


def _config(model_type="qwen3"):
    return SimpleNamespace(model_type=model_type, vocab_size=VOCAB, hidden_size=HID, num_attention_heads=HEADS,
                           num_key_value_heads=KV, head_dim=HD, intermediate_size=INTER)


def _tiny(model_type="qwen3", dtype=torch.float32):
    torch.manual_seed(0)
    return TinyForCausalLM(moe_layers=(1,) if model_type == "qwen3_moe" else ()).to(dtype)


def _trainer(model, model_type="qwen3", **kw):
    return ModuleBuiltTrainer(ModuleBuiltModel.from_model(model, _config(model_type)), **kw)


def _plain_logprobs(model, seqs, dtype=None):
    """The unwrapped model's packed forward and float32 (or float64) log-softmax at the targets."""
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(n) for n in lens])
    logits = model.compute_logits(model(input_ids=ids, positions=pos))
    lp = torch.log_softmax(logits.to(dtype or torch.float32), -1)
    out, start = [], 0
    for s in seqs:
        n = len(s)
        out.append(lp[start:start + n - 1].gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
        start += n
    return out


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_logprobs_are_the_unwrapped_models_bits(model_type):
    model = _tiny(model_type, torch.bfloat16)
    plain = copy.deepcopy(model)
    t = _trainer(model, model_type)
    with torch.no_grad():
        want = _plain_logprobs(plain, SEQS)
    got = t.logprobs(SEQS)
    assert isinstance(t, C.Trainer) and t.layouts == (C.Layout.PACKED,)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, what=f"{model_type} sequence {i}: module-built trainer vs the unwrapped model")
    by_one = t.logprobs(SEQS, layout=C.Layout.PACKED, micro_batch_size=1)
    for i, (a, b) in enumerate(zip(by_one, got)):
        assert_bitwise(a, b, what=f"{model_type} sequence {i}: micro-batches of 1 vs one micro-batch")


def test_capabilities_are_the_declared_ones():
    t = _trainer(_tiny())
    assert C.capabilities_of(t, C.TRAINER_CAPABILITIES) == ["TrainsRL", "LogprobsWithGrad", "DeclaresOptimizer",
                                                           "DeclaresBackwards", "ExportsGradients"]
    assert not isinstance(t, C.RunsEngineKernels)     # on the CPU stand-ins no vLLM kernel runs


def _relative_errors(got: dict, g32: dict, g64: dict) -> tuple[dict, float]:
    """Each tensor's max |g - g64| / max |g64|, and C8's model level C_MODEL * max(eps, FLOOR_U u)
    with eps the stock float32 run's worst (fixtures.checks.grad_model)."""
    def rel(a, b):
        return float((a.double() - b).abs().max()) / float(b.abs().max())
    eps = max(rel(g32[k], g64[k]) for k in g64 if g64[k].abs().max() > 0)
    return {k: rel(got[k], g64[k]) for k in g64 if g64[k].abs().max() > 0}, C_MODEL * max(eps, FLOOR_U * U32)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_backward_is_within_c8s_model_bound_of_float64_autograd(model_type):
    """logprobs_with_grad's backward (the wrapped layers' references) against autograd of the
    unwrapped module in float64, each parameter within the bound C8 applies to a trainer; the same
    gradients, exported, under the checkpoint names (ExportsGradients)."""
    model = _tiny(model_type)
    plain32, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    t = _trainer(model, model_type)
    got = _grads(model, -torch.cat(t.logprobs_with_grad(SEQS)).mean())
    g32 = _grads(plain32, -torch.cat(_plain_logprobs(plain32, SEQS)).mean())
    g64 = _grads(plain64, -torch.cat(_plain_logprobs(plain64, SEQS, torch.float64)).mean())
    errors, level = _relative_errors(got, g32, g64)
    assert len(errors) == len(list(model.parameters()))
    bad = {k: f"{e / level:.3g} x the bound" for k, e in errors.items() if not e <= level}
    assert not bad, bad
    model.zero_grad(set_to_none=True)
    (-torch.cat(t.logprobs_with_grad(SEQS)).mean()).backward()
    exported = t.export_gradients()
    assert sorted(exported) == sorted(t.export_weights())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert_bitwise(exported[q], model.model.layers[0].self_attn.qkv_proj.weight.grad[:HEADS * HD],
                   what="exported q_proj gradient vs the qkv_proj gradient's q rows")


def test_a_planted_wrong_reference_is_outside_that_bound():
    """Control of the test above: the fused add + RMSNorm reference with its residual path cut."""
    model = _tiny()
    plain32, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    from fixtures.vllm import module_wrap as MW

    def planted(x, r, w, eps):
        s = (x.float() + r.float()).to(x.dtype)
        return MW.ref_rms_norm(s, w, eps), s.detach()
    t = ModuleBuiltTrainer(ModuleBuiltModel.from_model(model, _config(), references={"fused_add_rms_norm": planted}))
    got = _grads(model, -torch.cat(t.logprobs_with_grad(SEQS)).mean())
    g32 = _grads(plain32, -torch.cat(_plain_logprobs(plain32, SEQS)).mean())
    g64 = _grads(plain64, -torch.cat(_plain_logprobs(plain64, SEQS, torch.float64)).mean())
    errors, level = _relative_errors(got, g32, g64)
    assert any(not e <= level for e in errors.values()), "a cut residual gradient stayed within the bound"


def _checkpoint_names(model_type):
    """The names the weight-export self-test's two-layer checkpoint of `model_type` holds
    (tests_meta/test_vllm_weight_export.py), for the tiny model's shapes."""
    from tests_meta.test_vllm_weight_export import _checkpoint
    return set(_checkpoint(model_type, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("model_type, optimizer", [("qwen3", "sgd"), ("qwen3_moe", "adamw")])
def test_train_step_moves_the_weights_and_the_export_has_the_checkpoints_names(model_type, optimizer):
    model = _tiny(model_type)
    t = _trainer(model, model_type, optimizer=optimizer, lr=1e-2)
    before = {k: v.clone() for k, v in t.export_weights().items()}
    hashes = t.weight_hashes()
    out = t.train_step(SEQS, prompt_lens=[2, 4, 1], advantages=[1.0, -0.5, 0.25])
    after = t.export_weights()
    assert set(out) == {"loss"} and torch.isfinite(torch.tensor(out["loss"]))
    assert sorted(after) == sorted(before) == sorted(hashes)
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert len(moved) > len(after) // 2, f"only {moved} moved"
    assert t.weight_hashes() != hashes
    assert set(after) == _checkpoint_names(model_type)
    assert after["model.embed_tokens.weight"].shape[0] == VOCAB                        # vocabulary padding trimmed
    vllm_params = dict(model.named_parameters())
    restacked = WE.stack_checkpoint(after, model_type)
    assert sorted(restacked) == sorted(vllm_params)
    for name, p in vllm_params.items():
        rows = VOCAB if name.endswith(WE.VOCAB_PADDED) else p.shape[0]        # padding rows are not exported
        assert_bitwise(restacked[name][:rows], p.detach()[:rows], what=f"{name}: the export stacked again vs the parameter")


def test_a_deep_copy_computes_with_its_own_weights():
    """C8 steps deep copies of the trainer: a copy's wrapped layers must be its own (a plain
    deepcopy of the closures would run the original's modules)."""
    t = _trainer(_tiny())
    twin = copy.deepcopy(t)
    twin.train_step(SEQS, prompt_lens=[2, 2, 2], advantages=[1.0, 1.0, 1.0])
    for i, (a, b) in enumerate(zip(twin.logprobs(SEQS), _plain_logprobs(twin.module(), SEQS))):
        assert_bitwise(a, b.detach(), what=f"sequence {i}: the stepped copy vs its own unwrapped module")
    assert not any(torch.equal(a, b) for a, b in zip(twin.logprobs(SEQS), t.logprobs(SEQS)))


def test_padded_layout_is_na():
    t = _trainer(_tiny())
    with pytest.raises(NotImplementedError, match="n/a: .* runs packed sequences only"):
        t.logprobs(SEQS, layout=C.Layout.PADDED)
    assert C.default_layout(t) is C.Layout.PACKED


def test_an_unknown_layer_is_na_naming_its_path_and_class():
    model = _tiny()
    model.model.layers[1].mlp.act_fn = V.FatreluAndMul()
    with pytest.raises(NotImplementedError, match=r"n/a: model\.layers\.1\.mlp\.act_fn is a FatreluAndMul"):
        _trainer(model)


def test_an_architecture_without_an_export_rule_is_na():
    with pytest.raises(NotImplementedError, match="n/a: no weight-export rule for model type 'falcon'"):
        _trainer(_tiny(), "falcon")


def test_the_suite_reports_the_unknown_layer_as_na(monkeypatch):
    """The preset's make_trainer raising it reaches the suite's trainer fixture as an n/a skip with
    the message (conftest.skip_not_available), as the hand-written trainer's unsupported_reason does."""
    from fixtures.core import outcomes
    from fixtures.vllm import implementation as vimpl
    impl = vimpl.module_trainer()
    assert impl.trainer_kind == "modules" and isinstance(impl, C.ConfiguresProcess)

    def build(model_dir, **kw):
        model = _tiny()
        model.model.layers[0].mlp.act_fn = V.FatreluAndMul()
        return _trainer(model)
    monkeypatch.setattr(ModuleBuiltTrainer, "build", staticmethod(build))
    with pytest.raises(NotImplementedError) as exc:
        impl._build_trainer("unused")
    with pytest.raises(outcomes.Skipped, match=r"^n/a: model\.layers\.0\.mlp\.act_fn is a FatreluAndMul"):
        outcomes.not_available(exc.value, "no trainer")


def test_the_preset_is_loadable_by_name():
    from fixtures.core.loader import BUILTIN, load_implementation
    assert BUILTIN["vllm-module-trainer"] == "fixtures.vllm.implementation:module_trainer"
    impl = load_implementation("vllm-module-trainer")
    assert "vLLM's own model class" in impl.describe()["trainer"]


@pytest.fixture
def fake_forward_context(monkeypatch):
    """A stand-in `vllm.forward_context.set_forward_context` that records each entry and whether
    a forward context is active."""
    calls, active = [], []

    @contextlib.contextmanager
    def set_forward_context(attn_metadata, vllm_config, num_tokens=None, **kw):
        calls.append((attn_metadata, vllm_config, num_tokens))
        active.append(True)
        try:
            yield
        finally:
            active.pop()
    mod = types.ModuleType("vllm.forward_context")
    mod.set_forward_context = set_forward_context
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", mod)
    return calls, active


def test_each_forward_enters_the_forward_context_once(fake_forward_context):
    calls, active = fake_forward_context
    model = _tiny("qwen3_moe")
    seen = []
    model.on_forward = lambda: seen.append(bool(active))
    cfg = object()
    t = ModuleBuiltTrainer(ModuleBuiltModel.from_model(model, _config("qwen3_moe"), cfg))
    t.logprobs(SEQS)
    assert calls == [(None, cfg, sum(map(len, SEQS)))] and seen == [True] and not active
    calls.clear()
    t.logprobs(SEQS, micro_batch_size=2)        # one forward per micro-batch
    assert calls == [(None, cfg, len(SEQS[0]) + len(SEQS[1])), (None, cfg, len(SEQS[2]))]
    calls.clear()
    (-torch.cat(t.logprobs_with_grad(SEQS)).mean()).backward()      # the backward is the references': no context
    assert len(calls) == 1


def test_no_vllm_config_means_no_forward_context(fake_forward_context):
    calls, _ = fake_forward_context
    _trainer(_tiny()).logprobs(SEQS)
    assert calls == []


# ---------------------------------------------------------------------------------------------
# C8's model-level check (fixtures.checks.grad_model) through ExportsGradients
# ---------------------------------------------------------------------------------------------
def _qwen3_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=VOCAB, hidden_size=HID, num_attention_heads=HEADS, num_key_value_heads=KV,
                       head_dim=HD, intermediate_size=INTER, num_hidden_layers=2, rms_norm_eps=1e-6,
                       max_position_embeddings=256, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _c8_model_check(references=None):
    from fixtures.checks import grad_checks as G
    cfg = _qwen3_config()
    model = _tiny()
    model.config = cfg                      # as vLLM's model classes keep it
    t = ModuleBuiltTrainer(ModuleBuiltModel.from_model(model, cfg, references=references))
    batches = G.seeded_batches(VOCAB)
    ref = G.reference_grads(t.module(), batches, weights=t.export_weights())
    rep = G.check_model_grads(t.module(), ref, lambda m, seqs: -torch.cat(t.logprobs_with_grad(seqs)).mean(),
                              kernel_mode=contextlib.nullcontext, gradients=t.export_gradients)
    return t, ref, rep


def test_c8_judges_the_exported_gradients_against_a_transformers_copy():
    """The reference is transformers' Qwen3 holding the exported weights (the vLLM-shaped module is
    no transformers model); the trainer's gradients are read under the same checkpoint names. Its
    float64 loss equals the trainer's up to rounding: the two models are the same function."""
    t, ref, rep = _c8_model_check()
    assert rep.ok, rep.message()
    assert set(rep.errors) == set(t.export_weights())
    assert 0 < rep.max_ratio <= 1


def test_c8_sees_a_planted_reference_through_the_export():
    """Control: the fused add + RMSNorm reference with its residual path cut is over the bound."""
    from fixtures.vllm import module_wrap as MW

    def planted(x, r, w, eps):
        s = (x.float() + r.float()).to(x.dtype)
        return MW.ref_rms_norm(s, w, eps), s.detach()
    _, _, rep = _c8_model_check({"fused_add_rms_norm": planted})
    assert not rep.ok
