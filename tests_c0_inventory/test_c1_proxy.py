"""Gate C1 - Proxy model: built from the real model's config (same architecture class, at least
one layer of every kind, experts >= top_k + 1, real widths on GPU), seeded random weights in the
model's own on-disk format, loads in engine and trainer, same op-kind set as the real model, and
a reproducible build (same seed -> same bytes)."""
from __future__ import annotations

import pytest
import torch

from fixtures.checks import op_kinds
from fixtures.checks.workloads import random_sequences
from fixtures.core.outcomes import not_applicable
from fixtures.models.proxies import ENGINE_DUMMY, build_proxy, layer_kinds, source_config

pytestmark = pytest.mark.C1

_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "num_attention_heads",
           "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts",
           "num_experts_per_tok", "tie_word_embeddings", "mamba_num_heads", "ssm_state_size", "state_size")


@pytest.fixture(scope="session")
def real_config(model_name):
    return source_config(model_name)


def test_same_architecture_class(proxy, real_config):
    real_arch = real_config.architectures or []
    assert proxy.config.model_type == real_config.model_type
    assert not real_arch or proxy.config.architectures == real_arch, \
        f"proxy architectures {proxy.config.architectures} != real {real_arch}"
    assert (proxy.path / "config.json").is_file()
    if proxy.weights_sha256 != ENGINE_DUMMY:     # an engine-dummy proxy is config only by design
        assert any(proxy.path.glob("*.safetensors")), f"no safetensors weights in {proxy.path}"


def test_every_layer_kind_kept(proxy, real_config):
    real, mine = set(layer_kinds(real_config)), set(proxy.layer_kinds)
    assert mine == real, f"layer kinds: real {sorted(real)}, proxy {sorted(mine)} (missing {sorted(real - mine)})"
    assert list(proxy.layer_kinds) == layer_kinds(proxy.config), "proxy spec disagrees with its own config"


def test_structural_relations_kept(proxy, real_config):
    """Whatever its widths, the proxy keeps the real config's relations: head_dim vs hidden / heads,
    tied vs untied LM head, MHA / GQA / MQA, a sliding window (fixtures.models.reduce.structural_relations)."""
    from fixtures.models.reduce import structural_relations
    real, mine = structural_relations(real_config), structural_relations(proxy.config)
    assert mine == real, f"the {proxy.size} proxy changed structural relations: real {real}, proxy {mine}"


def test_no_dropout_in_training(proxy, real_config):
    """Train-mode dropout draws a random mask per forward: no trainer logprob could equal the
    engine's. The proxy zeroes every dropout probability of the real config and says which; a
    checkpoint run (--proxy checkpoint) must have none (set them to 0 in your trainer too)."""
    from fixtures.models.admission import live_dropout
    live = live_dropout(proxy.config.to_dict())
    assert not live, (f"the {proxy.size} model trains with dropout {live}: train-mode dropout breaks parity "
                      "(set these to 0 in the config and in your trainer)")
    zeroed = getattr(proxy.config, "onpolicy_zeroed_dropout", None) or {}
    real = live_dropout(real_config.to_dict())
    assert zeroed == real, f"zeroed {zeroed}, real config's dropout {real}"
    if zeroed:
        print(f"the proxy zeroed the real config's dropout {zeroed}: your trainer must train without it too")


def test_experts_exceed_top_k(proxy):
    top_k = getattr(proxy.config, "num_experts_per_tok", None)
    experts = [getattr(proxy.config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
               if getattr(proxy.config, k, None)]
    if not top_k or not experts:
        not_applicable("no mixture-of-experts layers in this architecture")
    assert all(e >= top_k + 1 for e in experts), f"experts {experts} must be >= top_k + 1 = {top_k + 1}"


def test_reduced_experts_keep_the_routing_shape(proxy, real_config):
    """A shallow / full proxy with fewer routed experts (--proxy-experts) keeps the widths (checked
    below), top_k and the expert groups, and has more experts than top_k."""
    from fixtures.models.reduce import experts_cut_problems
    cut = getattr(proxy.config, "onpolicy_reduced_experts", None)
    if not cut:
        not_applicable("the proxy keeps every routed expert the config has")
    problems = experts_cut_problems(real_config.to_dict(), proxy.config.to_dict())
    assert not problems, f"the {proxy.size} proxy's expert cut {cut} broke the routing shape: " + "; ".join(problems)


def test_widths_fit_the_lane(proxy, real_config, impl):
    """Narrow widths only on the CPU lane: narrow GEMMs miss the variant kernel paths real widths hit."""
    if proxy.size == "checkpoint":
        assert proxy.path == proxy.path.resolve() and proxy.config.to_dict() == real_config.to_dict()
        return
    if proxy.size == "tiny":
        if str(impl.device()).startswith("cuda"):
            pytest.fail("a tiny (narrow) proxy on the GPU lane cannot give a GPU verdict: use --proxy shallow or full")
        return
    from fixtures.models.reduce import EXPERT_KEYS
    cut = getattr(proxy.config, "onpolicy_reduced_experts", None)    # judged by test_reduced_experts_keep_the_routing_shape
    for key in _WIDTHS:
        if cut and key in EXPERT_KEYS:
            continue
        if hasattr(real_config, key):
            assert getattr(proxy.config, key) == getattr(real_config, key), \
                f"{proxy.size} proxy changed {key}: {getattr(proxy.config, key)} vs real {getattr(real_config, key)}"
    if proxy.size == "full":
        assert proxy.config.num_hidden_layers == real_config.num_hidden_layers


def test_loads_in_trainer(trainer, proxy):
    seqs = random_sequences(proxy.config.vocab_size, (5, 9), seed=0)
    lps = trainer.logprobs(seqs)
    assert [lp.numel() for lp in lps] == [4, 8]
    assert all(torch.isfinite(lp).all() and (lp <= 0).all() for lp in lps)


def test_loads_in_engine(engine_factory, proxy):
    with engine_factory() as engine:
        lps = engine.prompt_logprobs([[1, 2, 3, 4]])
    assert lps[0].numel() == 3 and torch.isfinite(lps[0]).all()


def test_op_kinds_equal_real_model(trainer, proxy, real_config, request):
    """The proxy reaches the real model's op kinds. Kinds that differ because the trainer's module
    runs a custom autograd Function (its own backward) are named as such and left to C8, which
    judges that backward against float64; every other difference fails here."""
    module = trainer.module()
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None) or "eager"
    mine = op_kinds.op_kinds(module, vocab_size=proxy.config.vocab_size)
    first = next(module.parameters())
    real = op_kinds.real_op_kinds(real_config, attn_implementation=attn, dtype=first.dtype, device=first.device)
    if mine == real:
        return
    customs = op_kinds.custom_backwards(module, vocab_size=proxy.config.vocab_size)
    explained, unexplained = op_kinds.split_difference(mine, real, customs)
    if explained:
        request.node.user_properties.append(("note", op_kinds.custom_backward_note(customs, explained)))
    assert not unexplained, op_kinds.describe_difference(mine, real, customs=customs)


def test_build_is_reproducible(proxy, model_name, tmp_path, impl):
    if proxy.size == "checkpoint":
        not_applicable("--proxy checkpoint: no proxy is built, the checkpoint's own weights are tested")
    if proxy.weights_sha256 == ENGINE_DUMMY:
        not_applicable("an engine-dummy proxy (--proxy-weights engine-dummy) writes no weight files")
    again = build_proxy(model_name, proxy.size, tmp_path / "again", seed=proxy.seed, dtype=impl.dtype(),
                        experts=proxy.experts)
    assert again.weights_sha256 == proxy.weights_sha256, "same seed gave different weight bytes"
    assert (again.path / "config.json").read_bytes() == (proxy.path / "config.json").read_bytes()


def test_checkpoint_weights_reach_the_trainer(trainer, proxy):
    """--proxy checkpoint: the trainer holds the checkpoint's own tensors (a trainer that ignored the
    files and initialised its own would pass every parity gate on weights nobody trains)."""
    if proxy.size != "checkpoint":
        not_applicable("a proxy run: the proxy's build is checked by test_build_is_reproducible")
    from safetensors import safe_open
    exported = trainer.export_weights()
    matched, differ = 0, []
    for f in sorted(proxy.path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name in exported:
                    matched += 1
                    mine = exported[name].detach().cpu()
                    if not torch.equal(st.get_tensor(name).to(mine.dtype), mine):
                        differ.append(name)
    assert matched, f"none of the trainer's exported tensors is named as in {proxy.path}'s safetensors files"
    assert not differ, (f"{len(differ)} of {matched} tensors the trainer holds differ from {proxy.path}'s "
                        f"checkpoint, first {differ[0]}: the trainer did not load the checkpoint")
