"""The module-built trainer's wrapping (fixtures.vllm.module_wrap), on CPU stand-ins of vLLM's
layer classes (fixtures.vllm.fake_modules): every wrapped layer's forward gives the unwrapped
module's bits and leaves its inputs as they were; its backward (inputs and parameters) is within
C8's bound of autograd on a float64 copy; a planted wrong reference is caught by the same bound; a
layer kind or configuration the registry does not know is n/a naming the class and module path."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from fixtures.checks.grad_bounds import U32
from fixtures.checks.grad_model import C_MODEL, FLOOR_U
from fixtures.core.comparison import assert_bitwise
from fixtures.vllm import fake_modules as V
from fixtures.vllm import module_wrap as MW

T, H = 24, 32
LENS = [7, 17]


class Case(nn.Module):
    """One layer and how the model calls it."""

    def __init__(self, layer, call, lens=None):
        super().__init__()
        self.layer, self.call, self.lens = layer, call, lens

    def forward(self, *args):
        return self.call(self, *args)


def _attention():
    layer = V.Attention(4, 8, 8 ** -0.5, num_kv_heads=2)
    layer.lens = LENS
    return Case(layer, lambda c, q, k, v: c.layer(q, k, v), LENS), lambda g: (
        torch.randn(T, 32, generator=g), torch.randn(T, 16, generator=g), torch.randn(T, 16, generator=g))


def _logits():
    c = Case(nn.Module(), lambda c, h: c.lp(c.head, h))
    c.head, c.lp = V.ParallelLMHead(100, H), V.LogitsProcessor(100, soft_cap=5.0)
    return c, lambda g: (torch.randn(T, H, generator=g),)


def _moe():
    gate = V.ReplicatedLinear(H, 6)
    c = Case(nn.Module(), lambda c, x: c.experts(x, x))
    c.experts = V.MoERunner(V.FusedTopKRouter(2), V.RoutedExperts(6, H, 16), gate=gate)
    return c, lambda g: (torch.randn(T, H, generator=g),)


def _norm_weight(layer):
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.5)
    return layer


CASES = {
    "rms_norm": lambda: (Case(_norm_weight(V.RMSNorm(H)), lambda c, x: c.layer(x)), lambda g: (torch.randn(T, H, generator=g),)),
    "fused_add_rms_norm": lambda: (Case(_norm_weight(V.RMSNorm(H)), lambda c, x, r: c.layer(x, r)),
                                   lambda g: (torch.randn(T, H, generator=g), torch.randn(T, H, generator=g))),
    "q_norm_per_head": lambda: (Case(_norm_weight(V.RMSNorm(8)), lambda c, x: c.layer(x.view(T, 4, 8)).view(T, 32)),
                                lambda g: (torch.randn(T, 32, generator=g),)),
    "gemma_fused_add_rms_norm": lambda: (Case(_norm_weight(V.GemmaRMSNorm(H)), lambda c, x, r: c.layer(x, r)),
                                         lambda g: (torch.randn(T, H, generator=g), torch.randn(T, H, generator=g))),
    "qkv_proj": lambda: (Case(V.QKVParallelLinear(H, 8, 4, 2), lambda c, x: c.layer(x)[0]),
                         lambda g: (torch.randn(T, H, generator=g),)),
    "row_parallel_bias": lambda: (Case(V.RowParallelLinear(H, 48, bias=True), lambda c, x: c.layer(x)[0]),
                                  lambda g: (torch.randn(T, H, generator=g),)),
    "replicated_skip_bias_add": lambda: (Case(V.ReplicatedLinear(H, 20, bias=True, skip_bias_add=True),
                                              lambda c, x: sum(c.layer(x))), lambda g: (torch.randn(T, H, generator=g),)),
    "embedding": lambda: (Case(V.VocabParallelEmbedding(100, H), lambda c, i: c.layer(i)),
                          lambda g: (torch.randint(0, 100, (T,), generator=g),)),
    "logits": _logits,
    "silu_and_mul": lambda: (Case(V.SiluAndMul(), lambda c, x: c.layer(x)), lambda g: (torch.randn(T, 64, generator=g),)),
    "mul_and_silu": lambda: (Case(V.MulAndSilu(), lambda c, x: c.layer(x)), lambda g: (torch.randn(T, 64, generator=g),)),
    "gelu_tanh_and_mul": lambda: (Case(V.GeluAndMul("tanh"), lambda c, x: c.layer(x)),
                                  lambda g: (torch.randn(T, 64, generator=g),)),
    "rotary_neox_partial": lambda: (Case(V.RotaryEmbedding(16, 8, 4096, 10000.0, True), lambda c, p, q, k: c.layer(p, q, k)),
                                    lambda g: (torch.randint(0, 4096, (T,), generator=g), torch.randn(T, 64, generator=g),
                                               torch.randn(T, 32, generator=g))),
    "rotary_llama3_gptj": lambda: (Case(V.Llama3RotaryEmbedding(16, 16, 512, 500000.0, False),
                                        lambda c, p, q, k: c.layer(p, q, k)),
                                   lambda g: (torch.randint(0, 512, (T,), generator=g), torch.randn(T, 64, generator=g),
                                              torch.randn(T, 32, generator=g))),
    "attention": _attention,
    "moe": _moe,
}


def _outs(out):
    out = out if isinstance(out, tuple) else (out,)
    return [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _run(case, args, grad_seed=3, wrapped=None):
    """Outputs, and gradients of a seeded projection of them w.r.t. every float input and parameter."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    params = dict(case.named_parameters())
    ctx = wrapped.packed(case.lens) if (wrapped is not None and case.lens) else _null()
    with ctx:
        outs = _outs(case(*leaves))
    g = torch.Generator().manual_seed(grad_seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs)
    wrt = [x for x in leaves if x.requires_grad] + list(params.values())
    names = [f"input{i}" for i, x in enumerate(leaves) if x.requires_grad] + list(params)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [o.detach() for o in outs], {n: (torch.zeros_like(w) if gr is None else gr) for n, w, gr in zip(names, wrt, grads)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _judge(name, got: dict, g32: dict, g64: dict) -> list[str]:
    """C8's per-op bound (fixtures.checks.declared_backwards) applied to a wrapped layer: per tensor
    max |g - g64| <= C_MODEL * max(eps, FLOOR_U u) * max |g64|, eps the stock float32 autograd's own
    error, one per op. Returns the violations."""
    scale = {k: max(float(g64[k].abs().max()), float(g32[k].abs().max())) for k in g64}
    eps = max(float((g32[k].double() - g64[k]).abs().max()) / scale[k] for k in g64 if scale[k])
    bad = []
    for k in g64:
        bound = C_MODEL * max(eps, FLOOR_U * U32) * scale[k]
        err = float((got[k].double() - g64[k]).abs().max())
        if not (err <= bound):
            bad.append(f"{name} d/d{k}: max |g - g64| {err:.3g} > bound {bound:.3g} (eps {eps / U32:.3g}u)")
    return bad


def _grads_vs_float64(name, references=None):
    torch.manual_seed(0)
    case, make = CASES[name]()
    args = make(torch.Generator().manual_seed(1))
    plain32, plain64 = copy.deepcopy(case), copy.deepcopy(case).double()
    wrapped = MW.wrap_model(case, references=references).require_known()
    _, got = _run(case, args, wrapped=wrapped)
    _, g32 = _run(plain32, args)
    _, g64 = _run(plain64, [a.double() if a.is_floating_point() else a for a in args])
    return _judge(name, got, g32, g64), wrapped


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapped_forward_is_the_modules_bits_and_leaves_inputs_alone(name):
    torch.manual_seed(0)
    case, make = CASES[name]()
    case = case.to(torch.bfloat16)
    args = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in make(torch.Generator().manual_seed(1))]
    plain = copy.deepcopy(case)
    with torch.no_grad():
        want = _outs(plain(*[a.clone() for a in args]))
    w = MW.wrap_model(case).require_known()
    assert w.wrapped, "nothing was wrapped"
    before = [a.clone() for a in args]
    ctx = w.packed(case.lens) if case.lens else _null()
    with ctx:
        got = _outs(case(*args))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, what=f"{name} output {i}, wrapped vs the module's own forward")
    for i, (a, b) in enumerate(zip(args, before)):
        assert_bitwise(a, b, what=f"{name} input {i} after the wrapped call (a kernel wrote in place)")


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapped_backward_is_within_the_c8_bound_of_float64_autograd(name):
    bad, wrapped = _grads_vs_float64(name)
    assert not bad, "\n".join(bad)
    assert set(wrapped.backward_references()) <= set(MW.REFERENCES)


PLANTED = {
    "rms_norm": ("rms_norm", lambda x, w, eps: MW.ref_rms_norm(x, w, eps) if not x.requires_grad else
                 (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).detach() * w.float()).to(x.dtype)),
    "qkv_proj": ("linear", lambda x, w: (x.float() @ w.float().t()).to(torch.bfloat16).to(x.dtype)),
    "silu_and_mul": ("silu_and_mul", lambda x: MW.ref_mul_and_silu(x)),
    "rotary_neox_partial": ("rotary_cached", lambda p, q, k, cache, hs, rd, neox: MW.ref_cached_rotary(
        p, q, k, cache, hs, rd, not neox)),
    "attention": ("attention", lambda q, k, v, lens, scale: MW.ref_attention(q, k, v, [sum(lens)], scale)),
    "moe": ("routed_moe", lambda x, g, a, b, top_k, renorm: MW.ref_moe(x, MW.ref_linear(x, g).detach(), a, b, top_k, renorm)),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_wrong_backward_is_caught(name):
    """Negative control: the same judgement sees a wrong reference (a detached statistic, a bf16
    GEMM, the other half gated, the other rotary style, no packing boundary, a detached router)."""
    op, planted = PLANTED[name]
    bad, wrapped = _grads_vs_float64(name, references={op: planted})
    assert bad, f"planted {op} reference passed the bound"
    assert wrapped.backward_references()[op] is planted


def _model_with(*layers):
    m = nn.Module()
    for i, layer in enumerate(layers):
        m.add_module(f"layers{i}", layer)
    return m


def _quantised():
    layer = V.QKVParallelLinear(H, 8, 4, 2)
    layer.quant_method = type("Fp8LinearMethod", (), {})()
    return layer


def _offset_norm():
    layer = V.RMSNorm(H)
    layer.variance_size_override = 16
    return layer


@pytest.mark.parametrize("layer, cls, why", [
    (V.FatreluAndMul(), "FatreluAndMul", "no wrapper for this layer kind"),
    (V.DualChunkRotaryEmbedding(), "DualChunkRotaryEmbedding", "no wrapper for this layer kind"),
    (nn.Linear(4, 4), "Linear", "no wrapper for this layer kind"),
    (nn.GELU(), "GELU", "no wrapper for this layer kind"),
    (_quantised(), "QKVParallelLinear", "quant method Fp8LinearMethod"),
    (_offset_norm(), "RMSNorm", "variance_size_override"),
    (V.Attention(4, 8, 0.3, alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), "Attention", "alibi_slopes"),
    (V.ParallelLMHead(100, H), "ParallelLMHead", "no LogitsProcessor computes with it"),
    (V.MoERunner(V.FusedTopKRouter(2, scoring_func="sigmoid"), V.RoutedExperts(4, H, 8)), "MoERunner", "router"),
])
def test_an_unknown_layer_is_na_naming_class_and_path(layer, cls, why):
    model = _model_with(V.SiluAndMul(), layer)
    w = MW.wrap_model(model)
    reason = w.na_reason()
    assert reason and f"layers1 is a {cls}" in reason and why in reason, reason
    assert "layers0" not in reason, reason
    with pytest.raises(NotImplementedError, match=f"n/a: layers1 is a {cls}"):
        w.require_known()


def test_a_fully_known_model_is_not_na_and_unwraps():
    model = _model_with(V.SiluAndMul(), V.RMSNorm(H), V.RotaryEmbedding(8, 8, 64, 10000.0, True))
    w = MW.wrap_model(model).require_known()
    assert w.na_reason() is None and set(w.wrapped) == {"layers0", "layers1", "layers2"}
    assert all("forward" in model.get_submodule(p).__dict__ for p in w.wrapped)
    w.unwrap()
    assert not any("forward" in model.get_submodule(p).__dict__ for p in w.wrapped)
    assert set(w.backward_references()) == {"silu_and_mul", "rms_norm", "fused_add_rms_norm", "rotary_cached",
                                            "token_logprobs"}


def test_attention_reference_without_packed_lengths_is_an_error_not_a_guess():
    case, make = _attention()
    w = MW.wrap_model(case)
    args = [a.requires_grad_() for a in make(torch.Generator().manual_seed(1))]
    out = case(*args)
    with pytest.raises(RuntimeError, match="packed sequence lengths"):
        out.sum().backward()
    assert math.isfinite(float(out.detach().sum()))


class Qwen3DecoderLayer(nn.Module):
    """vLLM's Qwen3 layer order over the stand-ins (no parameters of its own)."""

    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _norm_weight(V.RMSNorm(H)), _norm_weight(V.RMSNorm(H))
        self.qkv_proj, self.o_proj = V.QKVParallelLinear(H, 8, 4, 2), V.RowParallelLinear(32, H)
        self.q_norm, self.k_norm = _norm_weight(V.RMSNorm(8)), _norm_weight(V.RMSNorm(8))
        self.rotary_emb, self.attn = V.RotaryEmbedding(8, 8, 256, 10000.0, True), V.Attention(4, 8, 8 ** -0.5, 2)
        self.gate_up_proj, self.act_fn, self.down_proj = V.MergedColumnParallelLinear(H, [48, 48]), V.SiluAndMul(), \
            V.RowParallelLinear(48, H)

    def forward(self, positions, h, residual):
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        q, k, v = self.qkv_proj(x)[0].split([32, 16, 16], -1)
        q = self.q_norm(q.reshape(-1, 4, 8)).reshape(-1, 32)
        k = self.k_norm(k.reshape(-1, 2, 8)).reshape(-1, 16)
        q, k = self.rotary_emb(positions, q, k)
        h = self.o_proj(self.attn(q, k, v))[0]
        x, residual = self.post_attention_layernorm(h, residual)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0], residual


class TinyQwen3(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens, self.layers = V.VocabParallelEmbedding(100, H), nn.ModuleList([Qwen3DecoderLayer() for _ in range(2)])
        self.norm, self.lm_head, self.logits_processor = _norm_weight(V.RMSNorm(H)), V.ParallelLMHead(100, H), V.LogitsProcessor(100)
        self.lens = LENS

    def forward(self, ids):
        positions = torch.cat([torch.arange(n) for n in LENS])
        for layer in self.layers:
            layer.attn.lens = LENS
        h, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return self.logits_processor(self.lm_head, h)


def test_a_whole_decoder_wrapped_is_its_own_bits_and_its_gradients_within_the_bound():
    """Every layer of a two-layer Qwen3-ordered model found by class and wrapped: the logits are
    the unwrapped model's bits; every parameter's gradient is within the bound of float64 autograd."""
    torch.manual_seed(0)
    model = TinyQwen3()
    ids = torch.randint(0, 100, (sum(LENS),), generator=torch.Generator().manual_seed(2))
    plain32, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    w = MW.wrap_model(model).require_known()
    assert set(w.wrapped.values()) == {"embedding", "rms_norm", "linear", "rotary_cached", "attention",
                                       "silu_and_mul", "logits"}
    with torch.no_grad():
        assert_bitwise(model(ids), plain32(ids), what="tiny Qwen3 logits, wrapped vs unwrapped")
    _, got = _run(model, [ids], wrapped=w)
    _, g32 = _run(plain32, [ids])
    _, g64 = _run(plain64, [ids])
    bad = _judge("tiny qwen3", got, g32, g64)
    assert not bad, "\n".join(bad)


def test_the_whole_decoder_judgement_sees_a_planted_fused_norm_backward():
    """Control of the test above: the fused add + RMSNorm's reference with its statistic detached."""
    torch.manual_seed(0)
    model = TinyQwen3()
    ids = torch.randint(0, 100, (sum(LENS),), generator=torch.Generator().manual_seed(2))
    plain32, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    detached = PLANTED["rms_norm"][1]

    def planted(x, r, w, eps):
        s = (x.float() + r.float()).to(x.dtype)
        return detached(s, w, eps), s
    w = MW.wrap_model(model, references={"fused_add_rms_norm": planted}).require_known()
    _, got = _run(model, [ids], wrapped=w)
    assert _judge("tiny qwen3", got, _run(plain32, [ids])[1], _run(plain64, [ids])[1])


# ---------------------------------------------------------------------------------------------
# C8's op-by-op judgement of what the module-built trainer declares (fixtures.checks.declared_ops)
# ---------------------------------------------------------------------------------------------
def test_every_declared_reference_is_an_op_c8_judges():
    """Every op a wrapped model can declare has a C8 definition (none goes unjudged as unknown),
    including those of every registry entry's call forms."""
    from fixtures.checks import declared_backwards as DB
    assert DB.unknown_ops(MW.REFERENCES) == []
    ops = {op for op, _ in MW.REGISTRY.values()}
    assert DB.unknown_ops({v for op in ops for v in MW.VARIANTS.get(op, (op,))}) == []


@pytest.mark.parametrize("op", ["linear", "embedding"])
def test_closed_form_backwards_are_within_c8s_bound(op):
    """C8 judges a declared function by its autograd; kernel_op's backward runs the reference's
    closed_grads instead where it has one (linear's GEMMs, embedding's tree sum per row). Through
    kernel_op - exactly the trainer's backward - they pass C8's per-op check too, and a planted
    closed form (a repeated id's gradient not accumulated) fails it."""
    from fixtures.checks import declared_backwards as DB
    from fixtures.checks.grad_cases import GradShape
    from fixtures.vllm.trainer_ops import kernel_op
    ref = MW.REFERENCES[op]
    used = []
    real = ref.closed_grads

    def counted(*a, **kw):
        got = real(*a, **kw)
        used.append(got is not None)
        return got

    def through_kernel_op(*args):
        return kernel_op(ref, ref, *args)
    shapes = [*DB.PINNED_SHAPES, GradShape(rows=33, width=17, out=16, inner=3, seed=5)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ref, "closed_grads", counted)
        for shape in shapes:
            assert DB.assert_declared_within_bound(op, through_kernel_op, shape).max_ratio <= 1
    assert used and all(used)
    if op == "embedding":
        def scattered(ids, w, *, grads, needs):
            return None, grads[0].new_zeros(w.shape).index_put((ids,), grads[0], accumulate=False)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ref, "closed_grads", scattered)
            assert all(not DB.check_declared(op, through_kernel_op, s, repeats=1).ok for s in shapes)
