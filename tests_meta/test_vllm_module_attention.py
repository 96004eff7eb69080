"""The module-built trainer's attention (#46) with a layer's own features - sliding window, logit
soft cap, sinks, scale - on the CPU stand-ins (fixtures.vllm.fake_modules: vLLM 0.26's Attention
with its FlashAttentionImpl attributes, and a CPU flash_attn_varlen_func with the semantics its
docstring gives, installed as vllm.vllm_flash_attn here).

Both wrappers are checked: module_wrap's own-forward one (MW.REGISTRY) and the trainer's prefill
one (fixtures.vllm.module_trainer.PREFILL_REGISTRY: fixtures.vllm.paged_attention over a paged
cache, the arguments FlashAttentionImpl passes). The wrapped forward is the unwrapped module's bits
and calls the kernel with the engine's window (w - 1, 0), soft cap and s_aux; the backward
(q, k, v and the sinks parameter) is within C8's bound of float64 autograd of the module; a window
off by one - in the wrapper's conversion or in the reference - and a dropped soft cap or sink are
seen; a feature the reference does not cover is n/a naming the layer and the attribute."""
from __future__ import annotations

import copy
import dataclasses
import sys
import types

import pytest
import torch
import torch.nn as nn

from fixtures.core.comparison import assert_bitwise
from fixtures.vllm import fake_modules as V
from fixtures.vllm import module_wrap as MW
from fixtures.vllm.module_trainer import PREFILL_REGISTRY
from test_vllm_module_wrap import Case, _judge, _run

LENS = [7, 17]
T, HEADS, KV, HD = sum(LENS), 4, 2, 8

FEATURES = {
    "full": {},
    "window": {"per_layer_sliding_window": 4},
    "softcap": {"logits_soft_cap": 2.0},
    "sinks": {"sinks": True},
    "gemma2_window_softcap": {"per_layer_sliding_window": 5, "logits_soft_cap": 1.5},
    "gpt_oss_window_sinks": {"per_layer_sliding_window": 3, "sinks": True},
    "scale_window_softcap_sinks": {"per_layer_sliding_window": 6, "logits_soft_cap": 3.0, "sinks": True, "scale": 0.25},
}
REGISTRIES = {"own_forward": MW.REGISTRY, "prefill": PREFILL_REGISTRY}


@pytest.fixture(autouse=True)
def fake_flash_attn(monkeypatch):
    """vllm.vllm_flash_attn.flash_attn_varlen_func -> the CPU stand-in (vLLM is not here)."""
    mod = types.ModuleType("vllm.vllm_flash_attn")
    mod.flash_attn_varlen_func = V.flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", mod)
    monkeypatch.setattr(V.flash_attn_varlen_func, "calls", [])
    return V.flash_attn_varlen_func.calls


def _case(feature: str):
    """An attention layer with `feature`, in a container that holds its sinks parameter (as
    gpt-oss's OAIAttention holds the `sinks` its Attention's impl reads)."""
    kw = dict(FEATURES[feature])
    scale = kw.pop("scale", HD ** -0.5)
    case = Case(nn.Module(), lambda c, q, k, v: c.layer(q, k, v), LENS)
    if kw.pop("sinks", False):
        case.sinks = nn.Parameter(torch.randn(HEADS, generator=torch.Generator().manual_seed(7)))
        kw["sinks"] = case.sinks
    case.layer = V.Attention(HEADS, HD, scale, num_kv_heads=KV, **kw)
    case.layer.lens = LENS
    return case


def _args(dtype=torch.float32):
    """q, k, v at a spread (x2) where a soft cap of 1.5-3 bends the logits."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(T, n, generator=g) * 2).to(dtype) for n in (HEADS * HD, KV * HD, KV * HD)]


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_wrapped_forward_is_the_modules_bits_with_the_engines_arguments(feature, registry, fake_flash_attn):
    torch.manual_seed(0)
    case = _case(feature).to(torch.bfloat16)
    args = _args(torch.bfloat16)
    with torch.no_grad():
        want = copy.deepcopy(case)(*args)
    w = MW.wrap_model(case, registry=REGISTRIES[registry]).require_known()
    assert w.wrapped == {"layer": "attention"}, w.wrapped
    with torch.no_grad(), w.packed(LENS):
        got = case(*args)
    assert_bitwise(got, want, what=f"{feature} attention ({registry} wrapper) vs the module's own forward")
    if registry == "prefill":
        (call,) = fake_flash_attn
        sw = FEATURES[feature].get("per_layer_sliding_window")
        assert call["window_size"] == ([-1, -1] if sw is None else [sw - 1, 0])
        assert call["softcap"] == FEATURES[feature].get("logits_soft_cap", 0.0)
        assert (call["s_aux"] is case.sinks) if "sinks" in FEATURES[feature] else call["s_aux"] is None
        assert call["causal"] is True and call["num_splits"] == 1 and call["scheduler_metadata"] is None
        assert call["softmax_scale"] == case.layer.impl.scale


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_wrapped_backward_is_within_the_c8_bound_of_float64_autograd(feature, registry):
    bad, wrapped = _grads(feature, registry)
    assert not bad, "\n".join(bad)
    assert set(wrapped.backward_references()) == {"attention", "token_logprobs"}


def _grads(feature, registry, references=None):
    torch.manual_seed(0)
    case, args = _case(feature), _args()
    plain32, plain64 = copy.deepcopy(case), copy.deepcopy(case).double()
    wrapped = MW.wrap_model(case, registry=REGISTRIES[registry], references=references).require_known()
    _, got = _run(case, args, wrapped=wrapped)
    _, g32 = _run(plain32, args)
    _, g64 = _run(plain64, [a.double() for a in args])
    if "sinks" in FEATURES[feature]:
        assert "sinks" in got and float(g64["sinks"].abs().max()) > 0, "the sinks parameter got no gradient"
    return _judge(f"{feature} ({registry})", got, g32, g64), wrapped


def _ref(**change):
    """ref_attention with one option changed (a planted wrong reference)."""
    def planted(q, k, v, lens, scale, window=(-1, -1), softcap=0.0, sinks=None):
        opts = dict(window=window, softcap=softcap, sinks=sinks)
        for key, f in change.items():
            opts[key] = f(opts[key])
        return MW.ref_attention(q, k, v, lens, scale, **opts)
    return planted


PLANTED = {
    "window_off_by_one": ("window", _ref(window=lambda w: (w[0] + 1, w[1]))),
    "softcap_dropped": ("softcap", _ref(softcap=lambda c: 0.0)),
    "sinks_dropped": ("sinks", _ref(sinks=lambda s: None)),
}


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_a_planted_reference_is_caught_by_the_bound(plant, registry):
    """Negative control of the backward: the reference's window one key wider, its soft cap or its
    sinks dropped - each fails the same bound on a layer with that feature."""
    feature, planted = PLANTED[plant]
    bad, wrapped = _grads(feature, registry, references={"attention": planted})
    assert bad, f"{plant}: the planted reference passed the bound"
    assert wrapped.backward_references()["attention"] is planted


def test_a_window_off_by_one_in_the_wrapper_is_seen_in_the_bits(monkeypatch, fake_flash_attn):
    """Negative control of the forward: the prefill wrapper passing FlashAttention (w, 0) for a
    layer's window w (one key too many per query) is not the module's bits."""
    real = MW.attention_features
    monkeypatch.setattr(MW, "attention_features", lambda m: dataclasses.replace(real(m), window=(real(m).window[0] + 1, 0)))
    case = _case("window").to(torch.bfloat16)
    args = _args(torch.bfloat16)
    with torch.no_grad():
        want = copy.deepcopy(case)(*args)
    w = MW.wrap_model(case, registry=PREFILL_REGISTRY).require_known()
    with torch.no_grad(), w.packed(LENS):
        got = case(*args)
    assert fake_flash_attn[0]["window_size"] == [4, 0]
    with pytest.raises(AssertionError):
        assert_bitwise(got, want, what="attention with the window off by one vs the module")


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_a_window_convention_off_by_one_is_refused_where_the_impl_says_otherwise(registry, monkeypatch):
    """The conversion of `sliding_window` w read off by one ((w, 0)) disagrees with the impl's own
    (w - 1, 0): n/a naming both, not a silent different window."""
    monkeypatch.setattr(MW, "engine_window", lambda w: (-1, -1) if w is None else (int(w), 0))
    reason = MW.wrap_model(_case("window"), registry=REGISTRIES[registry]).na_reason()
    assert reason and "impl.sliding_window (3, 0) is not the window (4, 0)" in reason, reason


def test_the_default_call_is_the_one_before_the_features():
    """A layer with none of the features calls the kernel as the hand-written trainer's prefill
    does (window [-1, -1], softcap 0.0, s_aux None), and the reference with no options."""
    from fixtures.vllm.paged_attention import paged_varlen_attention
    q, k, v = (a.reshape(T, -1, HD).to(torch.bfloat16) for a in _args())
    ks, vs = torch.split(k, LENS), torch.split(v, LENS)
    paged_varlen_attention(q, ks, vs, [(i, 0, n) for i, n in enumerate(LENS)], scale=0.3, num_splits=1)
    (call,) = V.flash_attn_varlen_func.calls
    assert (call["window_size"], call["softcap"], call["s_aux"]) == ([-1, -1], 0.0, None)
    assert MW.attention_features(_case("full").layer).options() == {}


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
@pytest.mark.parametrize("kw, why", [
    ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "alibi_slopes"),
    ({"attn_type": "encoder_only", "per_layer_sliding_window": 4}, "attn_type 'encoder_only'"),
    ({"kv_sharing_target_layer_name": "model.layers.0.attn"}, "kv_sharing_target_layer_name 'model.layers.0.attn'"),
    ({"head_size_v": 16}, "head_size_v 16"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
    ({"sinks": torch.zeros(2)}, "sinks of shape (2,)"),
])
def test_an_attention_feature_without_a_reference_is_na_naming_it(kw, why, registry):
    model = nn.Module()
    model.add_module("layers0", V.SiluAndMul())
    model.add_module("layers1", V.Attention(HEADS, HD, 0.3, num_kv_heads=KV, **kw))
    w = MW.wrap_model(model, registry=REGISTRIES[registry])
    reason = w.na_reason()
    assert reason and "layers1 is a Attention" in reason and why in reason and "layers0" not in reason, reason
    with pytest.raises(NotImplementedError, match="n/a: layers1 is a Attention"):
        w.require_known()


def test_the_module_holding_the_sinks_is_not_an_unknown_layer_but_one_with_another_parameter_is():
    """gpt-oss's OAIAttention holds the `sinks` parameter its Attention's impl computes with: no
    layer of its own for that; a parameter no known layer computes with still makes it unknown."""
    case = _case("sinks")
    assert MW.wrap_model(case).na_reason() is None
    case.bias = nn.Parameter(torch.zeros(3))
    reason = MW.wrap_model(case).na_reason()
    assert reason and "<root> is a Case: no wrapper for this layer kind" in reason, reason
