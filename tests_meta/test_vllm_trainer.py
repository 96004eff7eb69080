"""fixtures.vllm.trainer and its ops (fixtures.vllm.trainer_ops) on the CPU: the engine-layout
forward (vLLM's op order: merged QKV and gate-up GEMMs, per-head q/k norm, flat neox rotary, fused
residual-add norms) computes the same model as transformers, forward and backward, with the
plain-torch provider; kernel_op gives the kernel's forward bits and the reference's gradient;
unsupported models are "n/a". The GPU provider (vLLM's own kernels) is exercised by gate C7 with
--impl fixtures.vllm.implementation:engine_kernel_trainer."""
from __future__ import annotations

import pytest
import torch

from fixtures.reference import kernels as K
from fixtures.models import proxies as P
from fixtures.vllm import trainer as VT
from fixtures.vllm import trainer_ops as VO
from fixtures.core.contract import Layout
from fixtures.faults.variants import fused_norm_rerounds_from
from fixtures.reference.hf_trainer import HFTrainer, token_logprobs

SEQS = [[5, 17, 3, 99, 250, 7, 8], [1, 2], [400, 12, 12, 12, 60]]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def proxy_dir(request, tmp_path_factory):
    return P.build_proxy(request.param, "tiny", tmp_path_factory.mktemp(request.param), seed=3).path


def _hf_logprobs(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        if logits.dtype == torch.float64:     # the float64 truth keeps its precision to the end
            out.append(torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
        else:
            out.append(token_logprobs(logits[:-1], ids[0, 1:]))
    return out


def test_engine_layout_forward_is_the_same_model(proxy_dir):
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        mine = trainer.logprobs_with_grad(SEQS, layout=Layout.PACKED)
        ref = _hf_logprobs(trainer.model, SEQS)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_engine_layout_backward_matches_transformers(proxy_dir):
    """The gradient of a policy-gradient-like loss through kernel_op's reference backwards is the
    true gradient: against a float64 run of transformers' autograd, it is as accurate as
    transformers' own float32 gradient (within 8x, plus a few ULPs of the tensor's scale). The
    bound is derived from this machine's own float32 error, not a fixed tolerance, so a CPU whose
    BLAS rounds differently moves both errors together."""
    import copy
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    model = trainer.model
    model64 = copy.deepcopy(model).double()
    if hasattr(model64, "set_experts_implementation"):
        model64.set_experts_implementation("eager")      # grouped_mm has no float64 kernel

    def grads(m, lps):
        m.zero_grad(set_to_none=True)
        sum((torch.linspace(-1, 1, len(s) - 1, dtype=lp.dtype) * lp).sum() for s, lp in zip(SEQS, lps)).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    mine = grads(model, trainer.logprobs_with_grad(SEQS, layout=Layout.PACKED))
    ref = grads(model, _hf_logprobs(model, SEQS))
    exact = grads(model64, _hf_logprobs(model64, SEQS))
    assert mine.keys() == ref.keys() == exact.keys()
    eps = torch.finfo(torch.float32).eps
    for n in ref:
        scale = exact[n].abs().max().item()
        err_mine = (mine[n].double() - exact[n]).abs().max().item()
        err_ref = (ref[n].double() - exact[n]).abs().max().item()
        assert err_mine <= 8 * err_ref + 4 * eps * scale, \
            f"{n}: max error vs float64 {err_mine:.3g}, transformers' float32 {err_ref:.3g} (scale {scale:.3g})"


def test_kernel_op_forward_is_the_kernels_and_gradient_the_references():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)

    def kernel(a, b):                   # a "kernel" that rounds differently from the reference
        return VO.ref_linear(a, b) + 1e-3
    y = VO.kernel_op(kernel, VO.ref_linear, x, w)
    assert torch.equal(y.detach(), kernel(x.detach(), w.detach()))
    y.sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    VO.ref_linear(x2, w2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_tuple_outputs_and_integer_inputs():
    x, r, w = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True), torch.ones(6)
    y, res = VO.kernel_op(lambda a, b, c: VO.ref_fused_add_rms_norm(a, b, c, 1e-6),
                          lambda a, b, c: VO.ref_fused_add_rms_norm(a, b, c, 1e-6), x, r, w)
    (y.sum() + 2 * res.sum()).backward()
    assert x.grad is not None and r.grad is not None
    pos = torch.arange(3)
    q, k = torch.randn(3, 8, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    fn = lambda p, a, b: VO.ref_rotary(a, b, *VO.rope_cos_sin(p, 4, 10000.0, a.dtype), 4)  # noqa: E731
    qo, ko = VO.kernel_op(fn, fn, pos, q, k)
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is not None


def test_c8_model_bound_judges_the_reference_backwards(proxy_dir):
    """C8's model-level gradient check (fixtures.checks.grad_model) works for this trainer, whose
    module forward is not what it runs: its kernel_op reference backwards pass against the float64
    copy of its module, and the planted wrong custom backward (one projection's weight gradient
    scaled by 1 + 2^-10) is seen on it."""
    import contextlib
    from fixtures.checks import grad_checks as G
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    module = trainer.module()

    def loss(_model, seqs):
        return -torch.cat([lp.reshape(-1) for lp in trainer.logprobs_with_grad(seqs)]).mean()
    ref = G.reference_grads(module, G.seeded_batches(trainer.model.config.vocab_size, seeds=(0, 1)))
    own = contextlib.nullcontext          # RunsEngineKernels: its own backward, no dispatch mode
    rep = G.check_model_grads(module, ref, loss, kernel_mode=own)
    assert rep.ok, rep.message()
    with G.planted_in_trainer("projection_grad_scaled", module) as plant:
        bad = G.check_model_grads(module, ref, loss, kernel_mode=own)
    assert plant.engaged and plant.parameter in bad.violations, bad.message()


def test_c8_float64_side_makes_room_on_the_device_and_keeps_its_gradients_off_it(monkeypatch):
    """On a GPU the float64 copy runs beside the trainer once this worker's idle engines are closed
    to make room for it, and its kept gradients (a session-long fixture) go to the CPU, float32
    for a bf16 trainer."""
    from fixtures.checks import grad_model
    from fixtures.runtime import gpu_memory
    module = torch.nn.Linear(2000, 2000, dtype=torch.bfloat16, device="meta")    # no storage: a stand-in device
    need = (2000 * 2000 + 2000) * (8 * 2 + 2 * 2) + (1 << 30)
    rooms = []
    monkeypatch.setattr(gpu_memory, "fits_this_worker", lambda device, n: bool(rooms) and n == need)
    monkeypatch.setattr(gpu_memory, "make_room", lambda n=None: rooms.append(n) or 0)
    got = grad_model.reference_placement(module)
    assert got == grad_model.Placement(torch.device("meta"), torch.device("cpu"), torch.float32), got
    assert rooms == [need], rooms


def test_c8_reference_is_float32_on_the_device_when_float64_does_not_fit_a_16_bit_trainer(monkeypatch):
    """A bf16 trainer whose float64 copy does not fit this worker's share, but a float32 one does,
    gets the float32 copy on its device (not the CPU: 92-157 s a run on the H200) and the reason;
    a float32 trainer never gets a float32 reference (float64 on the CPU); nor does one where
    neither fits."""
    from fixtures.checks import grad_model
    from fixtures.runtime import gpu_memory
    n = 2000 * 2000 + 2000
    need32 = n * (8 + 4) + (1 << 30)       # float32 copy and gradient, the bf16 stock run's, 1 GiB
    meta, cpu = torch.device("meta"), torch.device("cpu")
    monkeypatch.setattr(gpu_memory, "make_room", lambda n=None: 0)
    fits = {need32}
    monkeypatch.setattr(gpu_memory, "fits_this_worker", lambda device, need: need in fits)
    got = grad_model.reference_placement(torch.nn.Linear(2000, 2000, dtype=torch.bfloat16, device="meta"))
    assert (got.device, got.dtype, got.keep_device, got.keep_dtype) == (meta, torch.float32, cpu, torch.float32), got
    assert "float64" in got.why and "does not fit" in got.why
    wide = grad_model.reference_placement(torch.nn.Linear(2000, 2000, dtype=torch.float32, device="meta"))
    assert (wide.device, wide.dtype) == (cpu, torch.float64), wide      # control: a float32 trainer
    fits.clear()
    short = grad_model.reference_placement(torch.nn.Linear(2000, 2000, dtype=torch.bfloat16, device="meta"))
    assert (short.device, short.dtype) == (cpu, torch.float64) and "nor float32" in short.why, short


def test_c8_float32_reference_of_a_bf16_trainer_judges_as_the_float64_one(proxy_dir, monkeypatch):
    """The float32 reference's own error is far under the bound it serves: against the float64
    reference on the same batches it is within 2^-10 of the bf16 trainer's bound level at every
    parameter; the correct trainer passes against it, the planted projection rises, and the
    message names the reference."""
    import contextlib
    from fixtures.checks import grad_checks as G
    from fixtures.checks import grad_model
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.bfloat16, device="cpu")
    module = trainer.module()
    batches = G.seeded_batches(trainer.model.config.vocab_size, seeds=(0, 1))
    ref64 = G.reference_grads(module, batches)
    cpu = torch.device("cpu")
    monkeypatch.setattr(grad_model, "reference_placement", lambda m: grad_model.Placement(
        cpu, cpu, torch.float32, torch.float32, "planted: float64 does not fit"))
    ref32 = G.reference_grads(module, batches)
    assert ref32.reference.startswith("float32 on cpu") and ref64.reference.startswith("float64 on cpu")
    for a, b in zip(ref32.g64, ref64.g64):
        worst = max(grad_model._relative_errors(a, b).values())
        assert worst <= ref64.level / 2 ** 10, (worst, ref64.level)
    assert abs(ref32.eps_stock - ref64.eps_stock) <= ref64.level / 2 ** 10

    def loss(_model, seqs):
        return -torch.cat([lp.reshape(-1) for lp in trainer.logprobs_with_grad(seqs)]).mean()
    own = contextlib.nullcontext
    rep = G.check_model_grads(module, ref32, loss, kernel_mode=own)
    assert rep.ok, rep.message()
    assert "float32 on cpu (planted: float64 does not fit)" in rep.message()
    with G.planted_in_trainer("projection_grad_scaled", module, u=ref32.u) as plant:
        bad = G.check_model_grads(module, ref32, loss, kernel_mode=own)
    assert plant.engaged and bad.ratios[plant.parameter] > 2 * rep.ratios[plant.parameter], bad.message()


@pytest.mark.parametrize("dtype, kept", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_c8_float64_side_moves_to_the_cpu_when_the_share_is_short(proxy_dir, monkeypatch, dtype, kept):
    """Where the float64 copy and its kept gradients do not fit this worker's GPU share (measured
    on the H200: 25-38 GiB against 29.75 at MoE widths), they run on the CPU, kept in float32 for
    a 16-bit trainer (2^-24 of the scale, far under its bound) and in float64 for a float32 one:
    the correct trainer still passes and the planted wrong backward is still seen."""
    import contextlib
    from fixtures.checks import grad_checks as G
    from fixtures.checks import grad_model
    from fixtures.runtime import gpu_memory
    monkeypatch.setattr(gpu_memory, "fits_this_worker", lambda device, need: False)
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=dtype, device="cpu")
    module = trainer.module()
    cpu = torch.device("cpu")
    where = grad_model.reference_placement(module)
    assert (where.device, where.keep_device, where.keep_dtype, where.dtype) == (cpu, cpu, kept, torch.float64), where

    def loss(_model, seqs):
        return -torch.cat([lp.reshape(-1) for lp in trainer.logprobs_with_grad(seqs)]).mean()
    ref = G.reference_grads(module, G.seeded_batches(trainer.model.config.vocab_size, seeds=(0, 1)))
    assert {g.dtype for batch in ref.g64 for g in batch.values()} == {kept}
    own = contextlib.nullcontext
    rep = G.check_model_grads(module, ref, loss, kernel_mode=own)
    assert rep.ok, rep.message()
    with G.planted_in_trainer("projection_grad_scaled", module, u=ref.u) as plant:
        bad = G.check_model_grads(module, ref, loss, kernel_mode=own)
    assert plant.engaged
    if dtype == torch.float32:
        assert plant.parameter in bad.violations, bad.message()
    else:   # a tiny bf16 proxy's stock run lands far from float64, so only the rise is asserted here
        assert bad.ratios[plant.parameter] > 2 * rep.ratios[plant.parameter], bad.message()


@pytest.mark.parametrize("model, why", [("mamba2", "covers qwen3"), ("nemotron_h", "covers qwen3"),
                                        ("llama", "default rotary only .*llama3")])
def test_unsupported_models_are_na(model, why, tmp_path):
    d = P.build_proxy(model, "tiny", tmp_path / model, seed=0).path
    with pytest.raises(NotImplementedError, match=f"^n/a: the engine-kernel trainer .*{why}"):
        VT.EngineKernelTrainer(d, VO.ReferenceOps, dtype=torch.float32, device="cpu")


def test_packed_only(proxy_dir):
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    assert trainer.layouts == (Layout.PACKED,)
    with pytest.raises(NotImplementedError, match="n/a"):
        trainer.logprobs(SEQS, layout=Layout.PADDED)
    assert isinstance(trainer, HFTrainer)     # optimizer, export and hashes are transformers'


def test_engine_model_runner_follows_vllm_rules(monkeypatch):
    """V2 for dense models, V1 for Qwen3-MoE and hybrids (vLLM 0.26, config/vllm.py:550);
    VLLM_USE_V2_MODEL_RUNNER overrides."""
    from fixtures.models.proxies import source_config
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    got = {m: VO.engine_model_runner(source_config(m)) for m in ("qwen3", "llama", "qwen3_moe", "nemotron_h", "mamba2")}
    assert got == {"qwen3": "v2", "llama": "v2", "qwen3_moe": "v1", "nemotron_h": "v1", "mamba2": "v1"}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert VO.engine_model_runner(source_config("qwen3_moe")) == "v2"


def test_hf_rotary_is_transformers_rotary_bit_for_bit(proxy_dir):
    """The transformers-backend trainer's rotary (fixtures.vllm.trainer_ops.hf_rotary) equals
    transformers' own rotary_emb + apply_rotary_pos_emb in bf16, bit for bit (CPU, torch.bmm)."""
    from transformers import AutoConfig
    from transformers.models.qwen3 import modeling_qwen3 as mq
    cfg = AutoConfig.from_pretrained(proxy_dir)
    if cfg.model_type != "qwen3":
        pytest.skip("one architecture is enough")
    hd, T = cfg.head_dim, 11
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, cfg.num_attention_heads * hd, generator=g).to(torch.bfloat16)
    k = torch.randn(T, cfg.num_key_value_heads * hd, generator=g).to(torch.bfloat16)
    pos = torch.arange(T) * 37
    rope = mq.Qwen3RotaryEmbedding(cfg)
    cos, sin = rope(q[None], pos[None])
    ref_q, ref_k = mq.apply_rotary_pos_emb(q.view(1, T, -1, hd).transpose(1, 2), k.view(1, T, -1, hd).transpose(1, 2),
                                           cos, sin)
    mq_, mk_, mcos, msin = VO.hf_rotary(pos, q, k, hd, VO.rope_theta(cfg))
    assert torch.equal(mcos, cos[0]) and torch.equal(msin, sin[0])
    assert torch.equal(mq_, ref_q.transpose(1, 2).reshape(T, -1))
    assert torch.equal(mk_, ref_k.transpose(1, 2).reshape(T, -1))


# ---------------------------------------------------------------------------------------------
# vLLM's tensor-parallel arithmetic on one device
# ---------------------------------------------------------------------------------------------
def test_all_reduce_rounds_the_exact_sum_once():
    """The all-reduce of two bf16 partials is their exact sum rounded once (what NCCL's bf16 sum
    gives for two ranks): the float32 sum rounded to bf16 never double-rounds away from it."""
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-3, 1e3):
        a = (torch.randn(4096, generator=g) * scale).to(torch.bfloat16)
        b = (torch.randn(4096, generator=g) * torch.logspace(-6, 2, 4096)).to(torch.bfloat16)
        exact = (a.double() + b.double()).to(torch.bfloat16)
        assert torch.equal(VO.ref_all_reduce(a, b), exact)
        assert torch.equal(VO.ref_all_reduce(a, b), VO.ref_all_reduce(b, a))


def test_tensor_parallel_forward_and_backward_are_the_same_model(proxy_dir):
    """TP=2 arithmetic (per-rank heads and MLP / expert slices, row-parallel partials summed)
    computes the TP=1 model: equal within float32 rounding, forward and gradient."""
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    model = trainer.model
    weights = [torch.linspace(-1, 1, len(s) - 1) for s in SEQS]

    def run(tp):
        model.zero_grad(set_to_none=True)
        with trainer.at_tensor_parallel(tp):
            lps = trainer.logprobs_with_grad(SEQS, layout=Layout.PACKED)
        sum((w * lp).sum() for w, lp in zip(weights, lps)).backward()
        return [lp.detach() for lp in lps], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    lp1, g1 = run(1)
    lp2, g2 = run(2)
    assert trainer.tensor_parallel_size == 1                     # restored
    for a, b in zip(lp1, lp2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_tensor_parallel_rounds_differently_in_bf16(proxy_dir):
    """Why C7 needs the engine's TP degree: in bf16 the per-rank partials round before the sum,
    so TP=2 arithmetic gives other bits than TP=1 (the C7 control relies on this)."""
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.bfloat16, device="cpu")
    with torch.no_grad():
        one = trainer.logprobs(SEQS, layout=Layout.PACKED)
        with trainer.at_tensor_parallel(2):
            two = trainer.logprobs(SEQS, layout=Layout.PACKED)
    assert not all(torch.equal(a, b) for a, b in zip(one, two))
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_tensor_parallel_records_only_whole_points(proxy_dir):
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu", tensor_parallel=2)
    assert trainer.tensor_parallel_size == 2 and "TP=2" in trainer.name
    points = trainer.module_outputs(SEQS[0])
    assert "model.layers.0.self_attn.o_proj" in points and "logits_processor" in points
    assert not any(k.endswith(("qkv_proj", ".self_attn.attn", "act_fn", "gate_up_proj")) for k in points)


def test_indivisible_tensor_parallel_is_na(proxy_dir):
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    heads = trainer.model.config.num_attention_heads
    with pytest.raises(NotImplementedError, match=f"^n/a: attention heads {heads}, .* not divisible by TP=3"):
        with trainer.at_tensor_parallel(3):
            pass
    with pytest.raises(NotImplementedError, match="TP=3"):
        VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu", tensor_parallel=3)


class _RowInvariantOps(VO.ReferenceOps):
    """ReferenceOps with the row-wise ops served by the suite's invariant kernels: a stock CPU
    GEMM or row reduction may round a row by the call's row count (MKL does on AVX-512 and
    under MKL_CBWR), and a localisation self-test must not depend on this CPU's BLAS."""
    name = "reference-ops+row-invariant"

    def linear(self, x, w):
        return K.linear(x.float(), w.float()).to(x.dtype)

    def rms_norm(self, x, w, eps):
        return (K.rms_norm(x.float(), [x.shape[-1]], None, eps)[0] * w.float()).to(x.dtype)

    def fused_add_rms_norm(self, x, residual, w, eps):
        r = (x.float() + residual.float()).to(x.dtype)
        return self.rms_norm(r, w, eps), r


# row-invariant ops, except the fused add + RMSNorm re-rounds one row in 37 from 256 rows up: what
# vLLM 0.26's CUDA kernel was measured to do (a launch switch at 256 tokens)
_NormSwitchAt256 = fused_norm_rerounds_from(_RowInvariantOps, start=11, step=37, name="reference-ops+norm-switch-at-256")


def test_module_outputs_in_a_batch_name_a_token_count_switch(proxy_dir):
    """C6's localisation for this trainer: a sequence's module outputs alone vs inside a packed
    micro-batch of 300 tokens; a norm that switches at 256 rows is named, with what is upstream
    of it equal; a clean provider shows every point equal (dense only: the plain-torch MoE reference
    groups tokens per expert, and CPU GEMMs round by row count)."""
    from fixtures.diagnose.module_outputs import compare_module_outputs
    seqs = [list(range(1, 40)), [7] * 200, [5, 9, 11] * 20]
    cases = [(_NormSwitchAt256, "model.layers.0.post_attention_layernorm")]
    if "moe" not in proxy_dir.name:
        cases.append((_RowInvariantOps, None))
    for ops, expect in cases:
        trainer = VT.EngineKernelTrainer(proxy_dir, ops, dtype=torch.float32, device="cpu")
        alone = list(trainer.module_outputs(seqs[2]).items())
        inside = trainer.module_outputs_in_batch(seqs, 2)
        result = compare_module_outputs(alone, inside, names=("alone", "in the batch"))
        assert result.compared and result.first == expect, result.describe()


def test_v2_whole_rows_hand_the_kernel_a_dense_id_array():
    """vLLM 0.26's V2 `compute_token_logprobs` kernel reads the ids of row r at r * k of their storage
    (it assumes a dense [rows, k] array): whole-vocabulary rows must pass materialised ids, not a
    stride-0 expand of one arange - which read past the storage (the illegal memory access of a C7
    control's convention diagnosis on the H200). The fake kernel here holds vLLM's precondition."""
    def dense_only_kernel(logits, ids):
        assert ids.is_contiguous() and ids.untyped_storage().nbytes() >= ids.numel() * ids.element_size(), \
            f"ids {tuple(ids.shape)} strides {ids.stride()}: the kernel would read past their storage"
        return torch.log_softmax(logits.float(), -1).gather(-1, ids)
    ops = object.__new__(VO.VLLMOps)
    ops.sampler, ops._logprobs = "v2", dense_only_kernel
    logits = torch.randn(5, 11)
    assert torch.equal(ops.vocab_logprobs(logits), torch.log_softmax(logits.float(), -1))


def test_c8_reads_the_same_expert_choices_from_router_logits_as_from_the_forward(tmp_path):
    """C8's routing replay (fixtures.checks.grad_routing) has two sources for this trainer: on the
    CPU its forward is the references (torch.topk, source 1); on the GPU vLLM's fused_topk, which
    leaves only its recorded `*.mlp.gate` logits (source 2). Both give the same choices."""
    import contextlib
    from fixtures.checks import grad_checks as G
    d = P.build_proxy("qwen3_moe", "tiny", tmp_path / "moe", seed=3).path
    trainer = VT.EngineKernelTrainer(d, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    module = trainer.module()
    batches = G.seeded_batches(trainer.model.config.vocab_size, seeds=(0,))
    stock = G.stock_copy(module, torch.float32)

    def loss(_model, seqs):
        return -torch.cat([lp.reshape(-1) for lp in trainer.logprobs_with_grad(seqs)]).mean()
    forward = G.trainer_routing(trainer, module, stock, batches, loss_fn=loss, trainer_mode=contextlib.nullcontext,
                                stock_loss=G.alone_loss)
    logits = G.trainer_routing(trainer, module, stock, batches, trainer_mode=contextlib.nullcontext,
                               loss_fn=lambda m, s: torch.zeros((), requires_grad=True), stock_loss=G.alone_loss)
    assert "forward's top-k" in forward.source and "router logits" in logits.source, (forward, logits)
    pairs = [(a, b) for fs, ls in zip(forward.batches[0], logits.batches[0]) for a, b in zip(fs, ls)]
    assert pairs and all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in pairs)


def test_a_deep_copy_of_the_trainer_shares_the_vllm_ops_and_copies_the_weights(proxy_dir):
    """C8's two-replica train step deep-copies the trainer. vLLM's ops provider holds vLLM's config
    context (a generator: on the H200 the copy raised "cannot pickle 'generator' object" and the
    check read n/a for the engine-kernel trainer); a copy shares the provider - kernels and a
    constant rotary table, no trainer state - and copies the weights and optimizer."""
    import contextlib
    import copy

    @contextlib.contextmanager
    def config_context():
        yield
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    ops = object.__new__(VO.VLLMOps)
    ops._config = config_context()
    with pytest.raises(TypeError, match="generator"):    # what a plain deep copy of the provider met
        copy.deepcopy(ops.__dict__)
    trainer.ops = ops
    replica = copy.deepcopy(trainer)
    assert replica.ops is ops
    mine, theirs = dict(trainer.model.named_parameters()), dict(replica.model.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(mine[n] is not theirs[n] and torch.equal(mine[n], theirs[n]) for n in mine)


def test_c8_train_step_twice_runs_on_this_trainer_and_its_control_fires(proxy_dir):
    """C8's two-replica train step (tests_c8_training: test_train_step_twice_same_weights) on the
    engine-kernel trainer: two deep copies step to the same weight bits, and the planted unordered
    scatter-add in the embedding's backward - reached through this trainer's F.embedding of the
    parameter - makes them differ."""
    from fixtures.checks import grad_checks as G
    trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.bfloat16, device="cpu")
    batch = G.repeated_ids_batch(trainer.model.config.vocab_size, tokens=256, distinct=8)
    kw = dict(prompt_lens=[4] * len(batch), advantages=[(-1.0) ** i * (1 + i) / len(batch) for i in range(len(batch))])
    assert G.train_steps_identical(trainer, batch, **kw) > 0
    with pytest.raises(AssertionError, match="after one train_step"):
        G.train_steps_identical(trainer, batch, **kw,
                                around=lambda r: G.planted_in_trainer("embedding_backward_unordered", r.module()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,cols,out", [(1, 16, 8), (17, 64, 300), (257, 96, 1000)])
def test_linear_backward_without_its_forward_is_autograds(dtype, rows, cols, out):
    """kernel_op differentiates the linear reference in closed form (ref_linear.closed_grads: the
    LM head's backward no longer rebuilds its float32 logits): bitwise the gradients autograd takes
    of ref_linear, for x and w. Control at the largest shape: the same products accumulated in
    float64 and cast are seen to differ from them, so equal bits are not a property of any
    formula."""
    g = torch.Generator().manual_seed(rows * 7 + cols)
    x = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(out, cols, generator=g) / cols ** 0.5).to(dtype).requires_grad_()
    up = torch.randn(rows, out, generator=g).to(dtype)
    ref = VO.ref_linear(x, w)
    want = torch.autograd.grad(ref, (x, w), up)
    got = VO.ref_linear.closed_grads(x.detach(), w.detach(), grads=(up,), needs=[True, True])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if rows == 257:
        in64 = ((up.double() @ w.double()).to(dtype), (up.double().t() @ x.double()).to(dtype))
        assert not all(torch.equal(a, b) for a, b in zip(in64, want)), "control: float64 accumulation is not seen"
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    assert all(torch.equal(a, b) for a, b in zip(
        torch.autograd.grad(VO.kernel_op(VO.ref_linear, VO.ref_linear, xs, ws), (xs, ws), up), want))


def test_trainer_backward_is_the_same_with_and_without_the_closed_form(proxy_dir, monkeypatch):
    """The engine-kernel trainer's parameter gradients (bf16, the packed forward) are the same bits
    whether the linear reference is differentiated in closed form or by rebuilding its forward."""
    def grads():
        trainer = VT.EngineKernelTrainer(proxy_dir, VO.ReferenceOps, dtype=torch.bfloat16, device="cpu")
        lps = trainer.logprobs_with_grad(SEQS, layout=Layout.PACKED)
        torch.stack([lp.sum() for lp in lps]).sum().backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    used = []
    real = VO.ref_linear.closed_grads

    def counted(*args, **kwargs):
        got = real(*args, **kwargs)
        used.append(got is not None)
        return got
    monkeypatch.setattr(VO.ref_linear, "closed_grads", counted)
    closed = grads()
    assert used and all(used), f"the closed form served {sum(used)} of {len(used)} linear backwards"
    monkeypatch.delattr(VO.ref_linear, "closed_grads")
    rebuilt = grads()
    assert closed.keys() == rebuilt.keys() and len(closed) > 5
    assert [n for n in closed if not torch.equal(closed[n], rebuilt[n])] == []
