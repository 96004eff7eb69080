"""Meta tests of fixtures/models/proxies.py: the proxies gate C1 relies on are what they claim to be."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fixtures.models import proxies as P  # noqa: E402

RECIPES = sorted(P.RECIPES)
FILES = ("config.json", "model.safetensors")


def _top_k(cfg):
    return getattr(cfg, "num_experts_per_tok", None)


def _experts(cfg):
    for key in ("num_experts", "n_routed_experts"):
        if getattr(cfg, key, None):
            return getattr(cfg, key)
    return None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each recipe's tiny proxy, built once for the module: name -> ProxySpec."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: P.build_proxy(name, "tiny", root / name) for name in RECIPES}


@pytest.fixture(scope="module", autouse=True)
def other_process(tmp_path_factory):
    """A build in a fresh interpreter (one thread, another model built first), started before the
    first test so that its start-up overlaps the others; test_..._in_another_process checks it."""
    out_dir = tmp_path_factory.mktemp("other_process")
    code = ("import sys, torch; torch.set_num_threads(1); from fixtures.models import proxies as P; "
            "P.build_proxy('llama', 'tiny', sys.argv[1] + '/first'); "
            "print(P.build_proxy('qwen3_moe', 'tiny', sys.argv[1] + '/x').weights_sha256)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-c", code, str(out_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    yield proc, out_dir
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


# --- configs: kind coverage and what each size keeps -------------------------------------------

@pytest.mark.parametrize("name", RECIPES)
def test_sizes_keep_every_layer_kind(name):
    real = P.source_config(name)
    before = real.to_dict()
    kinds = P.layer_kinds(real)
    assert len(kinds) == real.num_hidden_layers
    for size in P.SIZES:
        proxy = P.proxy_config(real, size)
        assert set(P.layer_kinds(proxy)) == set(kinds), size
        assert type(proxy) is type(real) and proxy.architectures == real.architectures
        assert proxy.tie_word_embeddings == real.tie_word_embeddings
    assert real.to_dict() == before, "proxy_config mutated its input"

    full = P.proxy_config(real, "full")
    assert P.layer_kinds(full) == kinds and full.hidden_size == real.hidden_size

    shallow = P.proxy_config(real, "shallow")
    got = P.layer_kinds(shallow)
    assert len(got) == max(2, len(set(kinds))) < len(kinds)
    assert [k for k in dict.fromkeys(got)] == [k for k in dict.fromkeys(kinds)], "order of kinds changed"
    for key in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "head_dim"):
        assert getattr(shallow, key, None) == getattr(real, key, None), key
    assert (_experts(shallow), _top_k(shallow)) == (_experts(real), _top_k(real))

    tiny = P.proxy_config(real, "tiny")
    assert P.layer_kinds(tiny) == got and tiny.hidden_size == 64 and tiny.vocab_size == 512
    assert tiny.dtype == torch.float32
    if _experts(real):
        assert _top_k(tiny) <= 2 and _experts(tiny) >= _top_k(tiny) + 1
        assert _experts(real) >= _top_k(real) + 1
    if hasattr(tiny, "chunk_size"):
        assert tiny.chunk_size == 8


def test_layer_kinds_vocabulary():
    assert P.layer_kinds("llama")[0] == "attention+mlp"
    assert set(P.layer_kinds("qwen3_moe")) == {"attention+moe"}
    assert set(P.layer_kinds("mamba2")) == {"mamba"}
    assert set(P.layer_kinds("nemotron_h")) == {"mamba", "attention", "moe", "mlp"}
    dense_first = P.source_config("qwen3_moe")
    dense_first.mlp_only_layers = [0, 5]
    kinds = P.layer_kinds(dense_first)
    assert kinds[0] == kinds[5] == "attention+mlp" and kinds[1] == "attention+moe"
    shallow = P.proxy_config(dense_first, "shallow")
    assert P.layer_kinds(shallow) == ["attention+mlp", "attention+moe"]


def test_nemotron_pattern_spellings(tmp_path):
    """Both the legacy hybrid_override_pattern and layers_block_type (legacy names too) give the kinds."""
    d = dict(P.RECIPES["nemotron_h"])
    d.pop("hybrid_override_pattern")
    d["layers_block_type"] = ["mamba", "attention", "moe", "mlp", "mamba"]
    d["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert P.layer_kinds(P.source_config(tmp_path)) == ["mamba", "attention", "moe", "mlp", "mamba"]
    assert P.layer_kinds(P.proxy_config(tmp_path, "shallow")) == ["mamba", "attention", "moe", "mlp"]


def _kinds_from_tensors(names, n_layers):
    """Each layer's kinds as the instantiated model has them (from its tensor names, not the config)."""
    kinds = []
    for i in range(n_layers):
        layer = [n for n in names if f"layers.{i}." in n]
        got = {k for k, marker in (("mamba", "A_log"), ("attention", "q_proj"), ("moe", ".experts."))
               if any(marker in n for n in layer)}
        if "moe" not in got and any(n.endswith("up_proj.weight") for n in layer):
            got.add("mlp")
        kinds.append(got)
    return kinds


@pytest.mark.parametrize("name", RECIPES)
def test_shallow_tensor_names_on_meta(name):
    """Shallow proxies are GBs, so only their meta skeleton is built: same tensors as tiny, real
    shapes, and the layers the model really instantiates are the ones layer_kinds names."""
    real = P.source_config(name)
    config = P.proxy_config(real, "shallow")
    shallow, n_shallow = P.tensor_specs(config)
    assert _kinds_from_tensors(shallow, config.num_hidden_layers) == \
        [set(k.split("+")) for k in P.layer_kinds(config)]
    tiny, _ = P.tensor_specs(P.proxy_config(real, "tiny"))
    pattern = re.compile(r"experts\.\d+\.")
    assert {pattern.sub("experts.N.", n) for n in shallow} == {pattern.sub("experts.N.", n) for n in tiny}
    embed = next(shape for n, shape in shallow.items() if n.endswith(("embed_tokens.weight", "embeddings.weight")))
    assert embed == (real.vocab_size, real.hidden_size)
    assert ("lm_head.weight" in shallow) != real.tie_word_embeddings
    if _experts(real):
        assert len({m.group(0) for n in shallow if (m := pattern.search(n))}) == _experts(real)
    assert n_shallow > 10**8


# --- builds -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RECIPES)
def test_tiny_builds_loads_and_runs(tiny, name):
    spec = tiny[name]
    assert sorted(os.listdir(spec.path)) == ["config.json", "model.safetensors", "proxy.json"]
    assert spec.layer_kinds == tuple(P.layer_kinds(spec.config))
    assert set(spec.layer_kinds) == set(P.layer_kinds(name))
    model = P.load_model(spec.path)  # refuses missing / unexpected / mismatched keys
    assert not model.training and model.config._attn_implementation == "eager"
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters
    disk = load_file(spec.path / "model.safetensors")
    loaded = P.disk_state_dict(model)
    assert loaded.keys() == disk.keys()
    assert all(torch.equal(loaded[k], disk[k]) for k in disk), "transformers changed weights on load"

    # Mamba layers also get a prompt spanning several chunks (and a partial one).
    lengths = [12] + ([3 * spec.config.chunk_size + 1] if hasattr(spec.config, "chunk_size") else [])
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, 512, (2, length), generator=torch.Generator().manual_seed(length))
            logits = model(ids).logits
            assert logits.dtype == torch.float32 and logits.shape == (2, length, 512)
            assert torch.isfinite(logits).all(), f"{name}: non-finite logits at length {length}"


def test_build_is_reproducible(tmp_path, tiny):
    ref = tiny["nemotron_h"]
    again = P.build_proxy("nemotron_h", "tiny", tmp_path / "again")
    for f in FILES:
        assert (ref.path / f).read_bytes() == (again.path / f).read_bytes(), f
    assert again.weights_sha256 == ref.weights_sha256
    assert ref.weights_sha256 == hashlib.sha256((ref.path / "model.safetensors").read_bytes()).hexdigest()

    other = P.build_proxy("nemotron_h", "tiny", tmp_path / "seed1", seed=1)
    assert (other.path / "config.json").read_bytes() == (ref.path / "config.json").read_bytes()
    assert (other.path / "model.safetensors").read_bytes() != (ref.path / "model.safetensors").read_bytes()


def test_build_is_reproducible_in_another_process(other_process, tiny):
    """A fresh interpreter, one thread, another model built first: still the same bytes."""
    proc, out_dir = other_process
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.split()[-1] == tiny["qwen3_moe"].weights_sha256
    assert (out_dir / "x" / "config.json").read_bytes() == (tiny["qwen3_moe"].path / "config.json").read_bytes()


def test_sharded_build_loads_same_weights(tmp_path, tiny):
    spec = P.build_proxy("qwen3_moe", "tiny", tmp_path / "sharded", max_shard_bytes=200_000)
    shards = sorted(p.name for p in spec.path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (spec.path / "model.safetensors.index.json").is_file()
    merged = {k: v for s in shards for k, v in load_file(spec.path / s).items()}
    single = load_file(tiny["qwen3_moe"].path / "model.safetensors")
    assert merged.keys() == single.keys() and all(torch.equal(merged[k], single[k]) for k in single)
    P.load_model(spec.path)


def test_bf16_build_records_dtype(tmp_path):
    spec = P.build_proxy("llama", "tiny", tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((spec.path / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(spec.path / "model.safetensors").values())
    model = P.load_model(spec.path, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_rebuild_in_place_but_never_clobber_user_dirs(tmp_path):
    P.build_proxy("qwen3", "tiny", tmp_path / "p")
    P.build_proxy("qwen3", "tiny", tmp_path / "p", seed=3)  # a previous proxy may be replaced
    assert json.loads((tmp_path / "p" / "proxy.json").read_text())["seed"] == 3
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(P.ProxyError, match="does not look like a proxy"):
        P.build_proxy("qwen3", "tiny", user)
    assert os.listdir(user) == ["notes.txt"]


# --- bad inputs -------------------------------------------------------------------------------

def _dir_with_config(tmp_path, text):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(P.ProxyError, match="no such directory") as e:
        P.source_config(missing)
    assert str(missing) in str(e.value) and "qwen3_moe" in str(e.value)
    with pytest.raises(P.ProxyError, match=re.escape(str(missing))):
        P.load_model(missing)
    with pytest.raises(P.ProxyError, match="no such directory"):
        P.build_proxy("no_such_recipe", "tiny", tmp_path / "out")


def test_directory_without_config(tmp_path):
    with pytest.raises(P.ProxyError, match="has no config.json") as e:
        P.source_config(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(P.ProxyError, match="has no config.json"):
        P.load_model(tmp_path)


@pytest.mark.parametrize("text,match", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "not an object"),
    ('{"hidden_size": 8}', "has no 'model_type'"),
])
def test_corrupt_config(tmp_path, text, match):
    d = _dir_with_config(tmp_path, text)
    for call in (P.source_config, P.load_model):
        with pytest.raises(P.ProxyError, match=match) as e:
            call(d)
        assert str(d / "config.json") in str(e.value)


def test_unknown_model_type_names_supported(tmp_path):
    d = _dir_with_config(tmp_path, json.dumps({"model_type": "gpt2"}))
    with pytest.raises(P.ProxyError, match="'gpt2' has no proxy recipe") as e:
        P.source_config(d)
    assert all(name in str(e.value) for name in RECIPES)
    (d / "config.json").write_text(json.dumps({"model_type": "not_a_real_arch"}))
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(P.ProxyError, match="not_a_real_arch"):
        P.load_model(d)


def test_unknown_size():
    with pytest.raises(P.ProxyError, match="unknown proxy size 'huge'.*tiny, shallow, full"):
        P.proxy_config(P.source_config("llama"), "huge")


def test_load_without_weights_or_with_bad_weights(tmp_path, tiny):
    d = _dir_with_config(tmp_path, (tiny["qwen3"].path / "config.json").read_text())
    with pytest.raises(P.ProxyError, match="no model.safetensors") as e:
        P.load_model(d)
    assert str(d) in str(e.value)
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(P.ProxyError, match="could not load the weights"):
        P.load_model(d)
    weights = load_file(tiny["qwen3"].path / "model.safetensors")
    weights.pop("model.norm.weight")
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(P.ProxyError, match="missing_keys.*model.norm.weight"):
        P.load_model(d)


def test_op_kinds_twin_follows_the_proxy_dtype(tmp_path):
    """A bf16 proxy (the GPU lane's) casts to fp32 inside its norms and attention; the structure
    twin traced in fp32 would not, so C1 traces the twin in the proxy's dtype (seen on the H200:
    8 `aten._to_copy` kinds "only in the proxy" before this)."""
    from fixtures.checks import op_kinds
    from fixtures.reference.implementation import ReferenceImplementation
    spec = P.build_proxy("qwen3", "tiny", tmp_path / "p", seed=0, dtype=torch.bfloat16)
    model = ReferenceImplementation(dtype=torch.bfloat16).make_trainer(spec.path).module()
    attn = model.config._attn_implementation
    mine = op_kinds.op_kinds(model, vocab_size=spec.config.vocab_size)
    assert mine == op_kinds.real_op_kinds(P.source_config("qwen3"), attn_implementation=attn, dtype=torch.bfloat16)
    assert mine != op_kinds.real_op_kinds(P.source_config("qwen3"), attn_implementation=attn)   # the trap



def test_op_kinds_leave_a_custom_backward_to_c8(tmp_path):
    """C1 names a custom autograd Function in the trainer's module as a custom backward (judged by
    C8) instead of a proxy-vs-real difference; a forward op the real model lacks still fails C1
    (the control), with or without a custom Function in the graph."""
    import types
    import torch.nn.functional as F
    from fixtures.checks import op_kinds

    class EinsumLinear(torch.autograd.Function):      # a correct custom backward, other aten ops
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return F.linear(x, w)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return torch.einsum("...o,oi->...i", g, w), torch.einsum("...o,...i->oi", g, x)

    spec = P.build_proxy("qwen3", "tiny", tmp_path / "p", seed=0)
    vocab = spec.config.vocab_size

    def kinds(patch):
        model = P.load_model(spec.path)
        proj = model.model.layers[0].self_attn.q_proj
        proj.forward = types.MethodType(patch, proj)
        return model, op_kinds.op_kinds(model, vocab_size=vocab)
    stock = op_kinds.op_kinds(P.load_model(spec.path), vocab_size=vocab)
    model, custom = kinds(lambda self, x: EinsumLinear.apply(x, self.weight))
    customs = op_kinds.custom_backwards(model, vocab_size=vocab)
    explained, unexplained = op_kinds.split_difference(custom, stock, customs)
    assert customs == ["EinsumLinearBackward"] and explained and not unexplained
    assert "custom backward: judged by C8" in op_kinds.describe_difference(custom, stock, customs=customs)
    for patch in (lambda self, x: F.linear(x * 1.0, self.weight),
                  lambda self, x: EinsumLinear.apply(x * 1.0, self.weight)):
        model, changed = kinds(patch)
        _, unexplained = op_kinds.split_difference(changed, stock, op_kinds.custom_backwards(model, vocab_size=vocab))
        assert any(k[0] != "backward" and k[2] == "aten.mul" for k in unexplained), unexplained


def test_engine_dummy_proxy_is_config_only(tmp_path):
    """--proxy-weights engine-dummy: config.json and the marker, no weight files; vLLM is told to
    draw its own weights; every loader that needs files says n/a instead of failing deep inside."""
    from fixtures.vllm import settings as vset
    from fixtures.core.contract import EngineSettings
    spec = P.build_engine_dummy("qwen3_moe", "full", tmp_path / "d")
    assert sorted(p.name for p in spec.path.iterdir()) == ["config.json", "proxy.json"]
    assert P.is_engine_dummy(spec.path) and spec.num_parameters > 30e9 and len(spec.layer_kinds) == 48
    assert vset.llm_kwargs(spec.path, EngineSettings())["load_format"] == "dummy"
    with pytest.raises(NotImplementedError, match="^n/a: .*engine-dummy proxy"):
        P.load_model(spec.path)
    real = P.build_proxy("qwen3", "tiny", tmp_path / "real", seed=0)
    assert not P.is_engine_dummy(real.path) and "load_format" not in vset.llm_kwargs(real.path, EngineSettings())


BAMBA = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "hidden_size": 4096, "num_hidden_layers": 32,
         "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128,
         "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False, "rope_theta": 10000.0}


@pytest.mark.parametrize("size", ["tiny", "shallow"])
def test_a_bamba_config_reduces_keeping_its_attention_layer(tmp_path, size):
    """Bamba lays its layers out by an index list and ties Mamba heads x head dim to expand x
    hidden: the cut renumbers the list (else the kept attention layer turns Mamba) and the narrowing
    keeps the tie (else transformers refuses the config)."""
    (tmp_path / "config.json").write_text(json.dumps(BAMBA))
    real = P.source_config(tmp_path)
    reduced = P.proxy_config(real, size)
    assert sorted(set(P.layer_kinds(reduced))) == sorted(set(P.layer_kinds(real))) == ["attention+mlp", "mamba+mlp"]
    if size == "tiny":
        assert reduced.mamba_n_heads * reduced.mamba_d_head == reduced.mamba_expand * reduced.hidden_size


@pytest.mark.parametrize("size", ["tiny", "shallow"])
def test_a_jamba_config_reduces_keeping_its_periodic_layout(tmp_path, size):
    """Jamba marks attention and expert layers by period / offset: the cut finds the pair that marks
    exactly the kept layers (else the kept attention layer turns Mamba), and a kept set no pair can
    mark is refused naming the field - never cut into other layer kinds."""
    from transformers import JambaConfig
    JambaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=16, vocab_size=512).save_pretrained(tmp_path / "ok")
    real = P.source_config(tmp_path / "ok")
    reduced = P.proxy_config(real, size)
    assert P.layer_kinds(reduced) == ["mamba+mlp", "mamba+moe", "attention+mlp"]
    assert (reduced.attn_layer_period, reduced.attn_layer_offset) == (3, 2)
    assert (reduced.expert_layer_period, reduced.expert_layer_offset) == (2, 1)
    JambaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=16, vocab_size=512,
                attn_layer_period=3, attn_layer_offset=1).save_pretrained(tmp_path / "odd")
    with pytest.raises(P.ProxyError, match=r"need expert layers at \[1, 2\] of 4, which no "
                                           r"expert_layer_period / expert_layer_offset pair expresses"):
        P.proxy_config(P.source_config(tmp_path / "odd"), size)


@pytest.mark.parametrize("size", ["tiny", "shallow"])
def test_a_zamba2_proxy_calls_its_shared_block_at_two_depths(size):
    """Zamba2's hybrid layers tie their attention block (num_mem_blocks of them, cycled): a proxy
    with one hybrid layer would never call a block twice, and an engine keeping one K/V per block
    instead of per calling layer would pass every gate (the fault matrix's
    shared_attention_kv_per_block: it did not fire on that proxy, measured). The cut keeps two
    hybrid layers and one block. Control: the same cut with the real num_mem_blocks (2) gives each
    kept layer a block of its own, and check_reduced refuses it by name."""
    from fixtures.models import reduce
    real = P.source_config(P.FAMILIES_DIR / "zamba2")
    kinds, shared = reduce.layer_layout(real)
    assert shared == {"mamba+attention+mlp"}
    reduced = P.proxy_config(real, size)
    assert reduce.layer_layout(reduced) == (["mamba", "mamba+attention+mlp", "mamba+attention+mlp"], shared)
    assert reduced.num_mem_blocks == 1
    keep = reduce.keep_layers(kinds, twice=shared)
    d = reduced.to_dict() | {"num_mem_blocks": real.num_mem_blocks}
    with pytest.raises(P.ProxyError, match=r"its \['mamba\+attention\+mlp'\] layers call a shared block, but the cut "
                                           r"config gives each kept layer a block of its own"):
        reduce.check_reduced(kinds, keep, reduce.make_config(d), size, shared)


def test_output_multipliers_do_not_flatten_the_proxy_logits(tmp_path):
    """FalconH1 multiplies its logits by lm_head_multiplier (0.039), Granite divides them by
    logits_scaling (6): on random weights that flattens the logits until a few ULP of difference
    in the hidden state never reach a logprob's bits. The proxy keeps the factor and draws the LM
    head (the tied embedding for Granite) with std / logit_scale; a family without one keeps std."""
    spreads = {}
    for name in ("falcon_h1", "granitemoehybrid", "bamba"):
        spec = P.build_proxy(P.FAMILIES_DIR / name, "tiny", tmp_path / name)
        model = P.load_model(spec.path)
        ids = torch.arange(40)[None] % spec.config.vocab_size
        with torch.no_grad():
            spreads[name] = float(model(input_ids=ids).logits.std())
    assert P.logit_scale(P.source_config(P.FAMILIES_DIR / "falcon_h1")) == pytest.approx(0.0390625)
    assert P.logit_scale(P.source_config(P.FAMILIES_DIR / "granitemoehybrid")) == pytest.approx(1 / 6)
    assert P.logit_scale(P.source_config(P.FAMILIES_DIR / "bamba")) == 1.0
    # control: bamba has no output factor, its head is drawn as before; the scaled ones spread alike
    for name in ("falcon_h1", "granitemoehybrid"):
        assert 0.5 < spreads[name] / spreads["bamba"] < 2, f"{name} proxy logits spread {spreads}"


# ---------------------------------------------------------------------------------------------
# configs a proxy must handle in one line (#44 item 6) and the structural relations it keeps
# ---------------------------------------------------------------------------------------------
FAMILIES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "models", "families")


def _family(name: str, **changes):
    from fixtures.models.reduce import make_config
    with open(os.path.join(FAMILIES, name, "config.json")) as f:
        d = json.load(f)
    d.update(changes)
    return make_config(d)


def test_an_attention_free_hybrid_is_refused_in_one_line():
    """Bamba with attn_layer_indices = null: every layer Mamba, which transformers' Bamba cannot
    run; control: the family's own config (three attention layers) runs."""
    from fixtures.models.admission import check_runs
    cfg = P.proxy_config(_family("bamba", attn_layer_indices=None), "tiny")
    with pytest.raises(P.ProxyError) as err:
        check_runs(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "no layer of it is attention" in msg and "get_mask_sizes" in msg, msg
    check_runs(P.proxy_config(_family("bamba"), "tiny"))


def test_dropout_is_zeroed_and_listed():
    cfg = P.proxy_config(_family("qwen2", attention_dropout=0.1), "tiny")
    assert cfg.attention_dropout == 0.0 and cfg.onpolicy_zeroed_dropout == {"attention_dropout": 0.1}
    assert not getattr(P.proxy_config(_family("qwen2"), "tiny"), "onpolicy_zeroed_dropout", None)


@pytest.mark.parametrize("name", sorted(os.listdir(FAMILIES)))
def test_tiny_and_shallow_proxies_keep_the_structural_relations(name):
    """head_dim vs hidden / heads (Qwen3-30B-A3B 128 vs 64, Gemma-2 256 vs 288), tied head,
    MHA / GQA / MQA, sliding window: the tiny proxy keeps each, so a stack that confuses head_dim
    with hidden / heads is seen on the CPU lane."""
    from fixtures.models.reduce import structural_relations
    real = P.source_config(os.path.join(FAMILIES, name))
    for size in ("tiny", "shallow"):
        assert structural_relations(P.proxy_config(real, size)) == structural_relations(real), (name, size)


def test_head_dim_relation_is_kept_not_defaulted():
    """Control: qwen3_moe's head_dim x heads exceeds hidden; its tiny proxy's does too (it was equal)."""
    from fixtures.models.reduce import structural_relations
    cfg = P.proxy_config(P.source_config("qwen3_moe"), "tiny")
    assert cfg.head_dim * cfg.num_attention_heads > cfg.hidden_size
    assert structural_relations(cfg)["head_dim x heads vs hidden"] == "larger"


def test_structural_relations_see_a_defaulted_head_dim():
    """Control of C1's test_structural_relations_kept: qwen3_moe's tiny proxy with head_dim set back
    to hidden / heads (what the tiny rule did before) no longer has the real relation."""
    from fixtures.models.reduce import make_config, structural_relations
    real = P.source_config("qwen3_moe")
    d = P.proxy_config(real, "tiny").to_dict()
    d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    assert structural_relations(make_config(d)) != structural_relations(real)
