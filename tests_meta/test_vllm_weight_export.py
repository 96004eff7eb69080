"""The module-built trainer's weight export (fixtures.vllm.weight_export): a checkpoint stacked as
vLLM 0.26 loads it and exported back gives the same names and bits, per architecture; the stacked
layout is vLLM's (q, k, v rows in order; w13 = gate then up); the rule table is what the model
files in vLLM's source say; a wrong split is caught; an unknown architecture is n/a."""
from __future__ import annotations

import ast
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fixtures.core.comparison import assert_bitwise
from fixtures.models import proxies as P
from fixtures.vllm import fake_modules as V
from fixtures.vllm import weight_export as WE

HID, HEADS, KV, HD, INTER, VOCAB, E = 32, 4, 2, 8, 48, 100, 4


def _config(model_type):
    return SimpleNamespace(model_type=model_type, hidden_size=HID, num_attention_heads=HEADS, num_key_value_heads=KV,
                           head_dim=HD, intermediate_size=INTER, vocab_size=VOCAB, q_lora_rank=24, kv_lora_rank=16,
                           qk_rope_head_dim=8, moe_intermediate_size=12, n_shared_experts=1)


def _checkpoint(model_type, g) -> dict[str, torch.Tensor]:
    """A two-layer checkpoint in transformers naming (layer 1 MoE where the architecture has experts)."""
    def t(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)
    ck = {"model.embed_tokens.weight": t(VOCAB, HID), "model.norm.weight": t(HID), "lm_head.weight": t(VOCAB, HID)}
    for i in range(2):
        p = f"model.layers.{i}"
        ck.update({f"{p}.input_layernorm.weight": t(HID), f"{p}.post_attention_layernorm.weight": t(HID)})
        if model_type == "deepseek_v3":
            ck.update({f"{p}.self_attn.q_a_proj.weight": t(24, HID), f"{p}.self_attn.kv_a_proj_with_mqa.weight": t(24, HID),
                       f"{p}.self_attn.q_a_layernorm.weight": t(24), f"{p}.self_attn.kv_a_layernorm.weight": t(16),
                       f"{p}.self_attn.q_b_proj.weight": t(HEADS * 16, 24), f"{p}.self_attn.kv_b_proj.weight": t(HEADS * 24, 16),
                       f"{p}.self_attn.o_proj.weight": t(HID, HEADS * 8)})
        else:
            ck.update({f"{p}.self_attn.q_proj.weight": t(HEADS * HD, HID), f"{p}.self_attn.k_proj.weight": t(KV * HD, HID),
                       f"{p}.self_attn.v_proj.weight": t(KV * HD, HID), f"{p}.self_attn.o_proj.weight": t(HID, HEADS * HD)})
        if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            ck.update({f"{p}.self_attn.q_norm.weight": t(HD), f"{p}.self_attn.k_norm.weight": t(HD)})
        arch = WE.ARCHITECTURES[model_type]
        if arch.experts and i == 1:
            gate, down, up = arch.experts
            block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
            ck[f"{p}.{block}.gate.weight"] = t(E, HID)
            for e in range(E):
                ck.update({f"{p}.{block}.experts.{e}.{gate}.weight": t(12, HID), f"{p}.{block}.experts.{e}.{up}.weight": t(12, HID),
                           f"{p}.{block}.experts.{e}.{down}.weight": t(HID, 12)})
            if model_type == "deepseek_v3":
                ck.update({f"{p}.mlp.shared_experts.gate_proj.weight": t(12, HID),
                           f"{p}.mlp.shared_experts.up_proj.weight": t(12, HID),
                           f"{p}.mlp.shared_experts.down_proj.weight": t(HID, 12)})
        elif model_type != "mixtral":
            ck.update({f"{p}.mlp.gate_proj.weight": t(INTER, HID), f"{p}.mlp.up_proj.weight": t(INTER, HID),
                       f"{p}.mlp.down_proj.weight": t(HID, INTER)})
    return ck


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma3_text", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"])
def test_round_trip_gives_the_checkpoints_names_and_bits(model_type):
    ck = _checkpoint(model_type, torch.Generator().manual_seed(5))
    params = WE.stack_checkpoint(ck, model_type)
    assert len(params) < len(ck), "nothing was stacked"
    assert params["model.embed_tokens.weight"].shape[0] == 128          # padded to 64 rows, as vLLM at TP=1
    back = WE.export_checkpoint(params, model_type, WE.sizes_from_config(_config(model_type), model_type),
                                vocab_size=VOCAB)
    assert sorted(back) == sorted(ck)
    for name in ck:
        assert_bitwise(back[name], ck[name], what=f"{model_type} {name}: exported vs checkpoint")


def _family_dirs():
    return {d.name: d for d in [*P.family_dirs(), *P.recipe_dirs()]}


def _proxy_checkpoint(d, seed):
    """The tiny proxy's checkpoint (on-disk names and shapes, transformers' reverse weight conversion:
    fixtures.models.proxies.tensor_specs), random bf16 bits; and its config."""
    cfg = P.proxy_config(P.source_config(d), "tiny")
    specs, _ = P.tensor_specs(cfg)
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g).to(torch.bfloat16) for n, s in specs.items()}, cfg


@pytest.mark.parametrize("name", sorted(_family_dirs()))
def test_every_family_round_trips_or_is_na_with_a_reason(name):
    """Each family config and recipe: its tiny proxy's checkpoint, stacked as vLLM loads it and
    exported back (shard sizes from sizes_from_config), gives the same names and bits; a model type
    without a rule is n/a with its reason (NOT_EXPORTED), never a silent pass-through."""
    ck, cfg = _proxy_checkpoint(_family_dirs()[name], 11)
    mt = cfg.model_type
    if mt not in WE.ARCHITECTURES:
        assert mt in WE.NOT_EXPORTED, f"{name} ({mt}): neither an export rule nor a reason for having none"
        with pytest.raises(NotImplementedError, match=f"n/a: no weight-export rule for model type '{mt}': "):
            WE.stack_checkpoint(ck, mt)
        return
    params = WE.stack_checkpoint(ck, mt, form="trainer")      # what the trainer holds (Mamba-2: A_log, not A)
    vocab = [t.shape[0] for n, t in params.items() if n.endswith(WE.VOCAB_PADDED)]
    assert vocab and all(v == -(-cfg.vocab_size // 64) * 64 for v in vocab), f"vocabulary rows {vocab}, not vLLM's padding"
    back = WE.export_checkpoint(params, mt, WE.sizes_from_config(cfg, mt), vocab_size=cfg.vocab_size)
    assert sorted(back) == sorted(ck)
    for n in ck:
        assert_bitwise(back[n], ck[n], what=f"{name} {n}: exported vs checkpoint")


def test_no_rule_and_reason_both():
    assert not set(WE.ARCHITECTURES) & set(WE.NOT_EXPORTED)


def test_gpt_oss_layout_is_vllms():
    """gpt-oss: .self_attn. -> .attn., embed_tokens -> embedding, w13 = gate_up_proj.permute(0, 2, 1)
    with its interleaved gate/up columns kept (rows 0, 2, ... gate), biases and sinks as they are."""
    ck, cfg = _proxy_checkpoint(_family_dirs()["gpt_oss"], 12)
    p = WE.stack_checkpoint(ck, "gpt_oss")
    pre = "model.layers.0"
    gu = ck[f"{pre}.mlp.experts.gate_up_proj"]
    w13 = p[f"{pre}.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (gu.shape[0], gu.shape[2], gu.shape[1]) and torch.equal(w13[1, ::2], gu[1][:, ::2].T)
    assert torch.equal(p[f"{pre}.mlp.experts.routed_experts.w2_weight"][2], ck[f"{pre}.mlp.experts.down_proj"][2].T)
    assert torch.equal(p[f"{pre}.mlp.experts.routed_experts.w13_bias"], ck[f"{pre}.mlp.experts.gate_up_proj_bias"])
    assert torch.equal(p[f"{pre}.attn.sinks"], ck[f"{pre}.self_attn.sinks"])
    q = cfg.num_attention_heads * cfg.head_dim
    assert torch.equal(p[f"{pre}.attn.qkv_proj.bias"][:q], ck[f"{pre}.self_attn.q_proj.bias"])
    assert p["model.embedding.weight"].shape[0] % 64 == 0 and "model.embed_tokens.weight" not in p
    back = WE.export_checkpoint(p, "gpt_oss", WE.sizes_from_config(cfg, "gpt_oss"))
    assert back[f"{pre}.mlp.experts.gate_up_proj"].data_ptr() == w13.data_ptr(), "the export is a view, not a copy"


def test_phi3_and_olmo2_load_whole():
    """phi3's checkpoint is already merged (qkv_proj, gate_up_proj) and olmo2 goes through the
    Transformers backend: vLLM's names are the checkpoint's, only the vocabulary is padded."""
    for name in ("phi3", "olmo2"):
        ck, _ = _proxy_checkpoint(_family_dirs()[name], 13)
        p = WE.stack_checkpoint(ck, name)
        assert sorted(p) == sorted(ck)
        assert all(torch.equal(p[n], ck[n]) for n in ck if not n.endswith(WE.VOCAB_PADDED))


def test_the_stacked_layout_is_vllms():
    """qkv rows are q, k, v; gate_up rows gate, up; w13[e] = gate then up; w2[e] = down (vLLM's shard offsets)."""
    ck = _checkpoint("qwen3_moe", torch.Generator().manual_seed(6))
    p = WE.stack_checkpoint(ck, "qwen3_moe")
    qkv = p["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:HEADS * HD], ck["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(qkv[HEADS * HD + KV * HD:], ck["model.layers.0.self_attn.v_proj.weight"])
    gu = p["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gu[INTER:], ck["model.layers.0.mlp.up_proj.weight"])
    w13 = p["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (E, 24, HID) and torch.equal(w13[2, :12], ck["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(p["model.layers.1.mlp.experts.routed_experts.w2_weight"][3],
                       ck["model.layers.1.mlp.experts.3.down_proj.weight"])


def test_a_wrong_split_is_caught():
    """Control: k and v sizes swapped for q and k (a wrong split of the same total) gives other
    bits under the checkpoint's names; sizes that do not add up raise, never a guessed split."""
    ck = _checkpoint("llama", torch.Generator().manual_seed(7))
    params = WE.stack_checkpoint(ck, "llama")
    sizes = WE.sizes_from_config(_config("llama"), "llama")
    wrong = dict(sizes, **{".qkv_proj": [KV * HD, HEADS * HD, KV * HD]})
    back = WE.export_checkpoint(params, "llama", wrong, vocab_size=VOCAB)
    assert back["model.layers.0.self_attn.q_proj.weight"].shape != ck["model.layers.0.self_attn.q_proj.weight"].shape
    with pytest.raises(ValueError, match="no shard sizes that add up"):
        WE.export_checkpoint(params, "llama", dict(sizes, **{".qkv_proj": [1, 2, 3]}))


def test_sizes_from_the_modules_are_the_configs():
    m = torch.nn.Module()
    m.qkv_proj = V.QKVParallelLinear(HID, HD, HEADS, KV)
    m.gate_up_proj = V.MergedColumnParallelLinear(HID, [INTER, INTER])
    got = WE.sizes_from_modules(m)
    cfg = WE.sizes_from_config(_config("qwen3"), "qwen3")
    assert got == {".qkv_proj": cfg[".qkv_proj"], ".gate_up_proj": cfg[".gate_up_proj"]}


def test_an_unknown_architecture_is_na():
    with pytest.raises(NotImplementedError, match="n/a: no weight-export rule for model type 'falcon'"):
        WE.stack_checkpoint({}, "falcon")
    with pytest.raises(NotImplementedError, match="A = -exp"):
        WE.architecture("jamba")


def _vllm_models_dir() -> Path | None:
    for d in (os.environ.get("VLLM_SRC"),):       # an unpacked wheel's vllm/ (no install needed)
        if d and (Path(d) / "model_executor/models/qwen2.py").exists():
            return Path(d) / "model_executor/models"
    try:
        import vllm
        return Path(vllm.__file__).parent / "model_executor/models"
    except Exception:
        return None


def _stacked_in_source(path: Path, cls: str) -> set[tuple[str, str, object]]:
    """`orig_to_new_stacked` of class `cls`'s hf_to_vllm_mapper, read with ast (nothing imported)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for call in ast.walk(node):
                if isinstance(call, ast.keyword) and call.arg == "orig_to_new_stacked":
                    d = ast.literal_eval(call.value)
                    return {(k, v[0], v[1]) for k, v in d.items()}
    raise AssertionError(f"{cls}.hf_to_vllm_mapper.orig_to_new_stacked not found in {path}")


def _class(path: Path, cls: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return node
    raise AssertionError(f"class {cls} not found in {path}")


def _mapper_dict(path: Path, cls: str, kind: str) -> dict:
    """`orig_to_new_<kind>` of class `cls`'s WeightsMapper, read with ast."""
    for call in ast.walk(_class(path, cls)):
        if isinstance(call, ast.keyword) and call.arg == f"orig_to_new_{kind}":
            return ast.literal_eval(call.value)
    raise AssertionError(f"{cls}: no orig_to_new_{kind} in {path}")


def _stacked_list(path: Path, cls: str, func: str = "load_weights") -> set[tuple[str, str, object]]:
    """A `stacked_params_mapping = [(param, shard_name, shard_id), ...]` in `cls.func`, as
    (checkpoint, vLLM, shard id) like the table."""
    for fn in ast.walk(_class(path, cls)):
        if isinstance(fn, ast.FunctionDef) and fn.name == func:
            for a in ast.walk(fn):
                if isinstance(a, ast.Assign) and getattr(a.targets[0], "id", None) == "stacked_params_mapping":
                    return {(w, p, s) for p, w, s in ast.literal_eval(a.value)}
    raise AssertionError(f"{cls}.{func}: no stacked_params_mapping in {path}")


def _bases(path: Path, cls: str) -> set[str]:
    return {b.id for b in _class(path, cls).bases if isinstance(b, ast.Name)}


@pytest.mark.parametrize("model_type, file, cls", [
    ("qwen3", "qwen2.py", "Qwen2Model"), ("llama", "llama.py", "LlamaModel"), ("mixtral", "mixtral.py", "MixtralModel"),
    ("qwen3_moe", "qwen3_moe.py", "Qwen3MoeModel"), ("gemma3_text", "gemma3.py", "Gemma3Model"),
    ("mistral", "llama.py", "LlamaModel"), ("gemma2", "gemma2.py", "Gemma2ForCausalLM"),
    ("qwen2_moe", "qwen2_moe.py", "Qwen2MoeForCausalLM"), ("lfm2", "lfm2.py", "Lfm2Model")])
def test_the_rule_table_is_what_vllms_model_files_say(model_type, file, cls):
    models = _models_or_skip()
    assert set(WE.ARCHITECTURES[model_type].stacked) == _stacked_in_source(models / file, cls)


def _models_or_skip() -> Path:
    models = _vllm_models_dir()
    if models is None:
        pytest.skip("vLLM's source is not here (set VLLM_SRC to its vllm/ directory): the table is held to it there")
    return models


def test_the_renames_are_what_vllms_model_files_say():
    """mistral's model is llama's; lfm2's and gpt-oss's renames and gpt-oss's q/k/v stacking are
    their files' (gpt-oss's expert suffixes land under routed_experts via remap_moe_expert_weights)."""
    models = _models_or_skip()
    assert "LlamaModel" in _bases(models / "mistral.py", "MistralModel")
    assert "LlamaForCausalLM" in _bases(models / "mistral.py", "MistralForCausalLM")
    assert dict(WE.ARCHITECTURES["lfm2"].substr) == _mapper_dict(models / "lfm2.py", "Lfm2Model", "substr")
    g = WE.ARCHITECTURES["gpt_oss"]
    assert dict(g.substr) == _mapper_dict(models / "gpt_oss.py", "GptOssForCausalLM", "substr")
    src = _mapper_dict(models / "gpt_oss.py", "GptOssForCausalLM", "suffix")
    for old, new in g.suffix:
        assert src[old.replace(".experts", "", 1)] == new.replace(".experts.routed_experts", "", 1), (old, new)
    assert set(g.stacked) == _stacked_list(models / "gpt_oss.py", "GptOssModel")
    assert "permute(0, 2, 1)" in ast.get_source_segment((models / "gpt_oss.py").read_text(),
                                                        _class(models / "gpt_oss.py", "GptOssModel"))


def test_phi3_and_olmo2_have_nothing_to_stack_in_vllms_files():
    """phi3 is llama's model with merged checkpoint names: none of llama's mapper keys occurs in a
    phi3 checkpoint name; olmo2 is served by the Transformers backend (no stacking); bamba and
    Qwen3_5ForCausalLM are not served (NOT_EXPORTED)."""
    models = _models_or_skip()
    assert _bases(models / "phi3.py", "Phi3ForCausalLM") == {"LlamaForCausalLM"}
    ck, _ = _proxy_checkpoint(_family_dirs()["phi3"], 14)
    keys = {k for k, _, _ in _stacked_in_source(models / "llama.py", "LlamaModel")}
    assert not [(k, n) for k in keys for n in ck if k in n]
    reg = (models / "registry.py").read_text()
    assert '"Olmo2ForCausalLM": ("transformers", "TransformersForCausalLM")' in reg
    assert '"BambaForCausalLM": "0.23.0"' in reg and '"Qwen3_5ForCausalLM"' not in reg


@pytest.mark.parametrize("mt", ["nemotron_h", "mamba2"])
def test_mamba2_a_is_the_loaders_and_only_the_trainers_a_log_is_exported(mt):
    """vLLM's loader stores A = -exp(A_log.float()) (mamba_mixer2.py's composed_weight_loader):
    the engine form holds that A under vLLM's name; the trainer form holds the checkpoint's A_log
    bits, and exports them under the checkpoint's name; an engine-side A is refused (n/a), not
    inverted."""
    ck, cfg = _proxy_checkpoint(_family_dirs()[mt], 14)
    pre = "model.layers.0.mixer" if mt == "nemotron_h" else "backbone.layers.0.mixer"
    a_log = ck["backbone.layers.0.mixer.A_log"]
    engine = WE.stack_checkpoint(ck, mt)
    assert_bitwise(engine[f"{pre}.A"], -torch.exp(a_log.float()), what=f"{mt} engine A vs the loader's lambda")
    trainer = WE.stack_checkpoint(ck, mt, form="trainer")
    assert f"{pre}.A" not in trainer and trainer[f"{pre}.A_log"] is a_log
    back = WE.export_checkpoint(trainer, mt, WE.sizes_from_config(cfg, mt), vocab_size=cfg.vocab_size)
    assert_bitwise(back["backbone.layers.0.mixer.A_log"], a_log, what=f"{mt} exported A_log vs the checkpoint's")
    with pytest.raises(NotImplementedError, match="not invertible bit for bit"):
        WE.export_checkpoint(engine, mt, WE.sizes_from_config(cfg, mt), vocab_size=cfg.vocab_size)
