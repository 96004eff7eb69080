"""fixtures.diagnose.module_outputs: recording every module's first output with hooks, and naming the
first differing point between two recordings (C7's module-by-module localisation) - checked both
ways: equal recordings pass, a planted one-ULP change is named exactly, with hex and ULP."""
from __future__ import annotations

import pytest
import torch

from fixtures.reference import kernels as K
from fixtures.diagnose import module_outputs as MO
from fixtures.models import proxies as P
from fixtures.vllm import trainer as VT
from fixtures.vllm import trainer_ops as VO


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return P.build_proxy("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"), seed=5).path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return P.build_proxy("qwen3_moe", "tiny", tmp_path_factory.mktemp("moe"), seed=5).path


SEQ = [5, 17, 3, 99, 250, 7, 8, 11, 2]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return self.act(self.proj(x))


class _Net(torch.nn.Module):
    """A block called twice and a tuple-returning, row-short call: what vLLM's layers do."""
    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.block(x)
        self.block(y)                   # a second call of the same modules: not recorded
        self.head(x[:1])                # fewer rows than recorded: passed over...
        return self.head(y), (y * 2, None, y + 1)[2]     # ...and its full call recorded


def test_hooks_record_first_full_call_in_completion_order():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(3, 4)
    rec = MO.record_module_outputs(net, lambda: net(x), rows=3)
    names = [k for k, _ in rec]
    assert names == ["block.proj", "block.act", "block", "head"], names
    assert torch.equal(dict(rec)["block"], net.block(x).detach())
    assert all(t.shape == (3, 4) or t.shape == (3, 2) for _, t in rec)
    assert not any(m._forward_hooks for m in net.modules()), "hooks must be removed"


def test_attention_layers_record_their_inputs_before_their_output():
    """A vLLM `Attention` layer's (q, k, v) are points of their own, before its output: vLLM shares
    one rotary module across layers, so without them a later layer's rotary difference would be
    named as an attention difference (measured on the H200: FA3 given the engine's q/K/V gave the
    engine's bits in the trainer's call)."""
    class Attention(torch.nn.Module):         # the class name vLLM's attention layer has
        def forward(self, q, k, v):
            return q + k * v

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.other = Attention(), torch.nn.Identity()

        def forward(self, x):
            return self.attn(x, x * 2, self.other(x))

    net, x = Layer(), torch.randn(3, 4)
    rec = MO.record_module_outputs(net, lambda: net(x), rows=3)
    names = [k for k, _ in rec]
    assert names == ["other", "attn:in", "attn:in#1", "attn:in#2", "attn"], names
    assert torch.equal(dict(rec)["attn:in#1"], x * 2)
    trainer_like = {k: t for k, t in rec}
    trainer_like["attn:in#1"] = trainer_like["attn:in#1"].clone().view(torch.int32).add(1).view(torch.float32)
    cmp = MO.compare_module_outputs(rec, trainer_like)
    assert not cmp.equal and cmp.describe().split("first diverging module output: ")[1].startswith("attn:in#1"), \
        cmp.describe()


def test_tuple_outputs_are_split():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return x * 2, None, x + 1
    pair, x = Pair(), torch.arange(6.0).reshape(3, 2)
    holder = torch.nn.Sequential(pair)
    rec = dict(MO.record_module_outputs(holder, lambda: pair(x), rows=3))
    assert set(rec) == {"0", "0#2"}
    assert torch.equal(rec["0"], x * 2) and torch.equal(rec["0#2"], x + 1)


def _points(n=4):
    return [(f"p{i}", torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4) * (i + 1)) for i in range(n)]


def test_compare_equal_and_planted():
    a = _points()
    assert MO.compare_module_outputs(a, dict(a)).equal
    b = dict(a)
    b["p2"] = VO.one_ulp_up_at_0(b["p2"])
    b["p3"] = b["p3"] + 1
    r = MO.compare_module_outputs(a, b)
    assert not r.equal and r.first == "p2" and r.differing_points == ["p2", "p3"]
    text = r.describe()
    assert "first diverging module output: p2 (2 upstream points equal" in text
    assert "1 of 12 elements differ" in text and "1 ULP apart" in text and "0x" in text
    assert "token 0, element 0" in text


def test_compare_structure_and_one_sided_points():
    a = _points(3)
    b = {"p0": a[0][1], "p1": a[1][1][:, :2], "extra": a[2][1]}
    r = MO.compare_module_outputs(a, b)
    assert r.first == "p1" and "(3, 4)" in r.detail and "(3, 2)" in r.detail
    assert r.only_a == ["p2"] and r.only_b == ["extra"]
    empty = MO.compare_module_outputs(a, {"x": a[0][1]})
    assert not empty.equal and "nothing to localise" in empty.describe()


@pytest.mark.parametrize("which", ["qwen3", "moe"])
def test_trainer_records_every_step_under_vllm_names(which, qwen3_dir, moe_dir):
    d = qwen3_dir if which == "qwen3" else moe_dir
    trainer = VT.EngineKernelTrainer(d, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    rec = trainer.module_outputs(SEQ)
    n_layers = trainer.model.config.num_hidden_layers
    expected = ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn.qkv_proj",
                "model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.rotary_emb",
                "model.layers.0.self_attn.rotary_emb#1", "model.layers.0.self_attn.attn:in",
                "model.layers.0.self_attn.attn:in#1", "model.layers.0.self_attn.attn:in#2", "model.layers.0.self_attn.attn",
                "model.layers.0.self_attn.o_proj", "model.layers.0.post_attention_layernorm#1",
                f"model.layers.{n_layers - 1}.input_layernorm#1", "model.norm", "model", "logits_processor"]
    expected += (["model.layers.0.mlp.gate", "model.layers.0.mlp.experts"] if which == "moe"
                 else ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.act_fn", "model.layers.0.mlp.down_proj"])
    assert set(expected) <= set(rec), sorted(set(expected) - set(rec))
    assert all(t.shape[0] == len(SEQ) for t in rec.values())
    with torch.no_grad():
        logits = VT.engine_layout_logits(trainer.model, trainer.ops, [SEQ])
    assert torch.equal(rec["logits_processor"], logits), "recording must not change the forward"


@pytest.mark.parametrize("which", ["qwen3", "moe"])
def test_planted_ulp_is_named_exactly(which, qwen3_dir, moe_dir):
    """The C7 control on the CPU: one op's output moved one ULP is the first point named."""
    d = qwen3_dir if which == "qwen3" else moe_dir
    trainer = VT.EngineKernelTrainer(d, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    clean = trainer.module_outputs(SEQ)
    planted_ops = VO.PlantedULP(trainer.ops, op="silu_and_mul") if which == "qwen3" else \
        VO.PlantedULP(trainer.ops, op="linear", call=1)
    trainer.ops = planted_ops
    planted = trainer.module_outputs(SEQ)
    r = MO.compare_module_outputs(list(clean.items()), planted)
    assert r.first == ("model.layers.0.mlp.act_fn" if which == "qwen3" else "model.layers.0.self_attn.o_proj")
    assert "1 of" in r.detail and "1 ULP apart" in r.detail
    assert planted_ops.calls > 1, "the plant is one call among several"


def test_hf_naming_keeps_only_points_with_a_transformers_twin(qwen3_dir):
    """For vLLM's Transformers backend: q/k/v and gate/up also as slices of the merged GEMMs, the
    norms' residuals and decoder-layer tuples dropped;
    names line up with a wrapper's nesting through canonical_name."""
    trainer = VT.EngineKernelTrainer(qwen3_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    vllm_named = trainer.module_outputs(SEQ)
    hf = trainer.module_outputs(SEQ, naming="hf")
    cfg = trainer.model.config
    q = hf["model.layers.0.self_attn.q_proj"]
    assert q.shape[1] == cfg.num_attention_heads * cfg.head_dim
    assert torch.equal(torch.cat([q, hf["model.layers.0.self_attn.k_proj"], hf["model.layers.0.self_attn.v_proj"]], -1),
                       vllm_named["model.layers.0.self_attn.qkv_proj"])
    assert "model.layers.0.mlp.gate_proj" in hf and "model.layers.0.mlp.down_proj" in hf
    assert not any("#" in k for k in hf), "fused norms' residuals have no transformers twin"
    assert "model.layers.0" not in hf and "model.norm" in hf and "model.layers.0.self_attn.qkv_proj" in hf
    wrapped = [("model.language_model." + k[len("model."):] if k.startswith("model.") else k, v) for k, v in hf.items()]
    assert MO.compare_module_outputs(wrapped, hf).equal
    with pytest.raises(ValueError, match="naming"):
        trainer.module_outputs(SEQ, naming="jax")


# ---------------------------------------------------------------------------------------------
# one request's rows inside a batch (C3's engine-side localisation for vLLM)
# ---------------------------------------------------------------------------------------------
def test_prompt_rows_are_located_in_a_flattened_step():
    prompt = torch.tensor([7, 3, 9, 9, 4])
    ids = torch.tensor([1, 2, 3, 7, 3, 9, 9, 4, 8, 8])          # another request (pos 0-2), the prompt, another
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1])
    rows, where = MO.locate_prompt_rows(ids, pos, prompt)
    assert rows.tolist() == [3, 4, 5, 6, 7] and where.tolist() == [0, 1, 2, 3, 4]
    rows, where = MO.locate_prompt_rows(torch.tensor([5, 9, 4]), torch.tensor([9, 3, 4]), prompt)   # a later chunk
    assert rows.tolist() == [1, 2] and where.tolist() == [3, 4]
    rows, _ = MO.locate_prompt_rows(torch.tensor([5, 6]), torch.tensor([12, 40]), prompt)         # decode only
    assert rows.numel() == 0
    rows, _ = MO.locate_prompt_rows(torch.tensor([7, 0, 7, 3, 9]), torch.tensor([0, 5, 0, 1, 2]), prompt)
    assert rows.tolist() == [2, 3, 4]                            # a chance single-token hit loses to the run
    with pytest.raises(ValueError, match="appear 2 times"):
        MO.locate_prompt_rows(torch.tensor([7, 3, 7, 3]), torch.tensor([0, 1, 0, 1]), prompt)


class _InvariantLinear(torch.nn.Linear):
    """nn.Linear served by the suite's row-invariant GEMM: a stock fp32 GEMM may give a row other
    bits in a 5-row call than in a 3-row one (MKL does on AVX-512), and this test must not
    depend on what this CPU's BLAS happens to do."""
    def forward(self, x):
        return K.linear(x, self.weight, self.bias)


class _InvariantLayerNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return K.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)[0]


class _Step(torch.nn.Module):
    """An engine model's shape: forward(input_ids, positions) over one flattened step; with
    `variant`, a step-size dependent term enters just before `norm` (a planted batch-variant op).
    Every op is row-invariant by construction, so the planted term is the only variant one."""
    def __init__(self, variant=False):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 4)
        self.mix = _InvariantLinear(4, 4)
        self.norm = _InvariantLayerNorm(4)
        self.variant = variant

    def forward(self, input_ids, positions):
        h = self.mix(self.embed_tokens(input_ids) + positions[:, None].float())
        if self.variant:
            h = h + input_ids.shape[0] * 1e-3
        return self.norm(h)


@pytest.mark.parametrize("variant", [False, True])
def test_request_rows_alone_vs_in_a_batch(variant):
    """Rows of one prompt recorded alone and inside a batch (split over two steps, as a chunked
    prefill would): equal for a row-wise model; with the planted op, the first position computed
    in a step of another size (3: the second step has 3 tokens, the lone prompt 5) at `norm`."""
    from fixtures.diagnose.engine_rows import EngineRows
    torch.manual_seed(0)
    model = _Step(variant)
    prompt = [7, 3, 9, 9, 4]

    def record(steps):
        with MO.RequestRows(model, prompt) as rec:
            with torch.no_grad():
                for ids, pos in steps:
                    model(input_ids=torch.tensor(ids), positions=torch.tensor(pos))
        rows = EngineRows("needle")
        for (p, _order, name, cls), t in rec.items():
            rows.add(p, name, cls, t)
        return rows
    alone = record([(prompt, [0, 1, 2, 3, 4])])
    inside = record([([1, 2, 7, 3, 9], [0, 1, 0, 1, 2]), ([9, 4, 8], [3, 4, 0])])
    assert len(alone.rows) == len(inside.rows) == 3 * len(prompt)
    found = alone.first_divergence(inside)
    if not variant:
        assert found is None
    else:
        assert found.startswith("token 3, norm (_InvariantLayerNorm)") and "ULP" in found
