"""fixtures.vllm.kernel_inventory and kernel_cases without a GPU: reading a profiler trace (kernel
-> launch -> innermost op, module and phase), the kernel table on the kernel names vLLM 0.26
launches on Hopper, the inventory's claims both ways, and the kernel_inventory command end to
end through the worker's fake backend. The GPU side runs in
tests_c0_inventory/test_c0_engine_kernels.py and tests_c5_invariance/test_c2_vllm_kernels.py."""
from __future__ import annotations

import json

import pytest

from fixtures.vllm import client as vclient
from fixtures.vllm import kernel_cases as VKC
from fixtures.vllm import kernel_inventory as VKI
from fixtures.core.kernel_table import Policy


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "args": args}


def synthetic_trace():
    """A decode step: a module range, an op inside it launching a GEMM, a bare Triton launch,
    and a kernel launched outside any module; plus a prefill step."""
    return {"traceEvents": [
        _x("user_annotation", "step:decode", 0, 100),
        _x("user_annotation", "mod:model.layers.0.mlp|Qwen3MLP", 10, 50),
        _x("user_annotation", "mod:model.layers.0.mlp.gate_up_proj|MergedColumnParallelLinear", 12, 20),
        _x("cpu_op", "aten::empty", 13, 1),
        _x("cuda_runtime", "cuLaunchKernelEx", 15, 2, correlation=1),
        _x("cpu_op", "_C::silu_and_mul", 40, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 41, 1, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 80, 1, correlation=3),
        _x("user_annotation", "step:prefill", 200, 50),
        _x("cpu_op", "aten::argmax", 210, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 212, 1, correlation=4),
        _x("kernel", "matmul_kernel_persistent", 500, 9, tid=99, correlation=1),
        _x("kernel", "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>(...)", 510, 3, tid=99,
           correlation=2),
        _x("kernel", "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 520, 1,
           tid=99, correlation=3),
        _x("kernel", "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>", 530, 4,
           tid=99, correlation=4),
    ]}


def test_read_trace_links_kernels_to_op_module_and_phase():
    got = {l.kernel.split("<")[0]: l for l in VKI.read_trace(synthetic_trace())}
    gemm = got["matmul_kernel_persistent"]
    # a bare Triton launch right after an op closed: no op, but the module range and the step
    assert (gemm.op, gemm.module, gemm.module_class, gemm.phase) == (
        "", "model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear", "decode")
    act = got["void vllm::act_and_mul_kernel"]
    assert (act.op, act.module, act.phase) == ("_C::silu_and_mul", "model.layers.0.mlp", "decode")
    outside = got["void at::native::vectorized_elementwise_kernel"]
    assert (outside.module, outside.phase) == ("", "decode")
    argmax = got["void at::native::reduce_kernel"]
    assert (argmax.op, argmax.phase) == ("aten::argmax", "prefill")


def test_an_architecture_vllm_does_not_serve_is_one_na_line_said_once(tmp_path, monkeypatch):
    """vLLM's registry refuses an architecture at engine start: VLLMArchitectureNotServed (an n/a,
    NotImplementedError) with vLLM's sentence, not its list of supported architectures; a second
    engine for the same model in this process says it at once, starting no worker."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "fake_unserved", "vocab_size": 1000, "eos_token_id": 7}))
    monkeypatch.setattr(vclient, "_NOT_SERVED_SEEN", {})
    with pytest.raises(vclient.VLLMArchitectureNotServed) as first:
        vclient.VLLMEngine(d, fake="not_served", log_dir=tmp_path)
    said = str(first.value)
    assert said.startswith("n/a: vLLM ") and "FakeUnservedForCausalLM'] are not supported for now" in said, said
    assert "Supported architectures" not in said and isinstance(first.value, NotImplementedError)
    started = []
    monkeypatch.setattr(vclient, "spawn_worker", lambda *a, **k: started.append(a) or pytest.fail("spawned"))
    with pytest.raises(vclient.VLLMArchitectureNotServed, match="not supported for now"):
        vclient.VLLMEngine(d, fake="not_served", log_dir=tmp_path)
    assert not started


def test_a_fix_that_does_not_serve_the_configuration_is_an_na_line(tmp_path):
    """The mamba2 fix refuses prefix caching at engine start: VLLMConfigurationNotServed (n/a) with
    the fix's sentence and the settings asked; the same model without prefix caching starts."""
    from fixtures.core.contract import EngineSettings
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "vocab_size": 1000, "eos_token_id": 7}))
    with pytest.raises(vclient.VLLMConfigurationNotServed, match=r"^n/a: mamba2: prefix caching is not served") as e:
        vclient.VLLMEngine(d, EngineSettings(enable_prefix_caching=True), fake="fix_refused", log_dir=tmp_path)
    assert isinstance(e.value, NotImplementedError) and "enable_prefix_caching=True" in str(e.value)
    with vclient.VLLMEngine(d, EngineSettings(enable_prefix_caching=False), fake="fix_refused",
                            log_dir=tmp_path) as eng:
        assert eng.alive


def test_the_mamba2_fix_starts_mamba2_models_without_prefix_caching(monkeypatch, tmp_path):
    """--vllm-fixes ...,mamba2: a Mamba-2 model's engines default to prefix caching off (the fix
    serves mamba_cache_mode 'none' only); any other model's defaults are left as they are."""
    from fixtures.vllm import fixes, implementation as vimpl, mamba2_patch
    base = vimpl.VLLMImplementation().defaults
    assert base.enable_prefix_caching
    assert not mamba2_patch.engine_defaults_for({"model_type": "nemotron_h"}, base).enable_prefix_caching
    assert mamba2_patch.engine_defaults_for({"model_type": "qwen3"}, base) is base
    impl = vimpl.VLLMImplementation()
    for mt in ("bamba", "qwen3"):
        (tmp_path / mt).mkdir()
        (tmp_path / mt / "config.json").write_text(json.dumps({"model_type": mt}))
    monkeypatch.setenv(fixes.FIXES_ENV, "all,mamba2")
    assert not impl._defaults_for(tmp_path / "bamba").enable_prefix_caching
    assert impl._defaults_for(tmp_path / "qwen3").enable_prefix_caching
    monkeypatch.setenv(fixes.FIXES_ENV, "all")
    assert impl._defaults_for(tmp_path / "bamba").enable_prefix_caching


@pytest.mark.parametrize("kernel, op, policy, case", [
    ("matmul_kernel_persistent", "", Policy.KERNEL, "linear"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "aten::mm", Policy.KERNEL, "linear"),
    ("_rms_norm_kernel", "", Policy.KERNEL, "rms_norm"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(...)", "_C::fused_add_rms_norm", Policy.KERNEL,
     "fused_add_rms_norm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)", "_C::rotary_embedding", Policy.KERNEL, "rotary"),
    ("void vllm::act_and_mul_kernel<...>", "_C::silu_and_mul", Policy.KERNEL, "silu_and_mul"),
    ("void flash::FlashAttnFwdSm90<...>", "_vllm_fa3_C::fwd", Policy.KERNEL, "attention"),
    ("_topk_log_softmax_kernel", "", Policy.KERNEL, "token_logprobs"),
    ("fused_moe_kernel", "", Policy.KERNEL, "fused_moe"),
    ("void vllm::moe::topkGatingSoftmax<...>", "_moe_C::topk_softmax", Policy.KERNEL, "router"),
    ("void vllm::reshape_and_cache_flash_kernel<...>", "_C_cache_ops::reshape_and_cache_flash", Policy.MOVEMENT, ""),
    ("void at::native::reduce_kernel<...ArgMaxOps...>", "aten::argmax", Policy.MOVEMENT, ""),
    ("void at::native::reduce_kernel<...func_wrapper...>", "aten::sum", Policy.KERNEL, "torch_reduce"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "aten::add", Policy.ELEMENTWISE, ""),
    ("void at::native::index_elementwise_kernel<...>", "aten::index", Policy.MOVEMENT, ""),
])
def test_kernel_table_on_hopper_names(kernel, op, policy, case):
    rule = VKI.classify(kernel, op)
    assert rule is not None, f"{kernel} under {op} is unmapped"
    assert (rule.policy, rule.case) == (policy, case), f"{kernel} under {op}: {rule}"


def test_unknown_kernel_is_unmapped():
    assert VKI.classify("some_new_custom_reduction_kernel", "_C::mystery") is None


def test_every_rule_names_an_existing_case():
    """The table's claims point at cases the C2 file runs (and only KERNEL rules name one)."""
    for rule in VKI.RULES:
        if rule.policy is Policy.KERNEL:
            assert rule.case in VKC.CASES and not VKC.CASES[rule.case].planted, rule
        else:
            assert not rule.case, rule


def test_inventory_summary_and_artifacts():
    inv = VKI.KernelInventory.from_launches(VKI.read_trace(synthetic_trace()), model="m", settings={"x": 1},
                                           module_classes={"Qwen3MLP": ["model.layers.0.mlp"]})
    assert inv.launches == 4 and not inv.unmapped
    assert set(inv.kernel_cases()) == {"linear", "silu_and_mul"}
    head = VKI.Launch("matmul_kernel_persistent", "", "logits_processor", "LogitsProcessor", "sample")
    with_head = VKI.KernelInventory.from_launches([head], model="m", settings={})
    assert set(with_head.kernel_cases()) == {"linear", "lm_head"}
    assert inv.phases_seen() == {"decode", "prefill"}
    json.dumps(inv.as_dict())
    md = inv.markdown()
    assert "matmul_kernel_persistent" in md and "UNMAPPED" not in md


def test_cases_for_dense_and_moe():
    dense = VKC.dims_from_config({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512})
    moe = VKC.dims_from_config({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    assert "fused_moe" not in VKC.cases_for(dense) and "fused_moe" in VKC.cases_for(moe)
    assert not any(VKC.CASES[c].planted for c in VKC.cases_for(moe))
    assert dense["head_dim"] == 16 and dense["kv_heads"] == 4


def test_kernel_inventory_through_the_worker_protocol(tmp_path):
    """The parent's kernel_inventory() over the real pipe (fake backend): launches come back,
    the unknown kernel is reported unmapped with its op and module."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    from fixtures.core.contract import Request, SamplingParams
    with vclient.VLLMEngine(d, fake="echo", log_dir=tmp_path) as eng:
        inv = eng.kernel_inventory([Request("a", (1, 2, 3), SamplingParams(max_tokens=2))], model="fake")
    assert inv.launches == 4
    assert [e.kernel for e in inv.unmapped] == ["fake_mystery_kernel"]
    assert inv.unmapped[0].ops == {"fake::op"} and inv.unmapped[0].module_classes == {"Qwen3MLP"}
    assert inv.phases_seen() == {"prefill", "decode"}


def test_kernel_inventory_refuses_graphs(tmp_path):
    from fixtures.core.contract import EngineSettings
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    with vclient.VLLMEngine(d, EngineSettings(cuda_graphs=True), fake="echo", log_dir=tmp_path) as eng:
        with pytest.raises(ValueError, match="eager"):
            eng.kernel_inventory([])


def test_refused_invariance_is_a_clear_red_not_a_skip(tmp_path):
    """vLLM 0.26 refuses VLLM_BATCH_INVARIANT=1 for Mamba backends at start-up: the adapter turns
    that into VLLMInvarianceRefused (a failure naming vLLM's reason), while the same model with
    invariance off starts (the controls show what users get)."""
    from fixtures.core.contract import EngineSettings
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "vocab_size": 1000, "eos_token_id": 7}))
    with pytest.raises(vclient.VLLMInvarianceRefused, match="MAMBA2_ATTN.*gate is red"):
        vclient.VLLMEngine(d, fake="refuse_bi", log_dir=tmp_path)
    assert not issubclass(vclient.VLLMInvarianceRefused, NotImplementedError)   # never read as "n/a"
    spawned = []                    # a second batch-invariant start in this process: refused at once
    real_spawn = vclient.spawn_worker
    vclient.spawn_worker = lambda *a, **k: spawned.append(1) or real_spawn(*a, **k)
    try:
        with pytest.raises(vclient.VLLMInvarianceRefused, match="MAMBA2_ATTN"):
            vclient.VLLMEngine(d, fake="refuse_bi", log_dir=tmp_path)
        assert not spawned
    finally:
        vclient.spawn_worker = real_spawn
    with vclient.VLLMEngine(d, EngineSettings(batch_invariant=False), fake="refuse_bi", log_dir=tmp_path) as stock:
        assert stock.alive


@pytest.mark.parametrize("kernel, op, policy, case", [
    # names seen on the H200 (vLLM 0.26.0, Qwen3-MoE shallow, eager, FLASH_ATTN), 2026-11-30
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::...", "_vllm_fa3_C::fwd",
     Policy.KERNEL, "attention"),
    ("void flash::prepare_varlen_num_blocks_kernel<1, false>(int, int, int, int const*, int c...", "_vllm_fa3_C::fwd",
     Policy.MOVEMENT, ""),
    ("Memcpy DtoH (Device -> Pinned)", "aten::copy_", Policy.MOVEMENT, ""),
    ("Memset (Device)", "aten::sum", Policy.MOVEMENT, ""),
    ("triton_red_fused_ge_sum_0", "triton_red_fused_ge_sum_0", Policy.MOVEMENT, ""),
    ("_compute_slot_mapping_kernel", "", Policy.MOVEMENT, ""),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wra...", "aten::amax",
     Policy.MOVEMENT, ""),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wra...", "aten::sum",
     Policy.KERNEL, "torch_reduce"),
    ("std::enable_if<((0)==(0))||(!vllm::_typeConvert<c10::BFloat16>::exists), void>::type vl...",
     "_C::fused_add_rms_norm", None, None),
])
def test_kernel_table_on_h200_names(kernel, op, policy, case):
    """The kernel names the H200 run listed; the fused-add norm's name is truncated by the
    profiler to its enable_if prefix, so it is matched by its op (see the rule)."""
    rule = VKI.classify(kernel, op)
    if policy is None:
        assert rule is not None and rule.case == "fused_add_rms_norm", rule
        return
    assert rule is not None, f"{kernel} under {op} is unmapped"
    assert (rule.policy, rule.case) == (policy, case), f"{kernel} under {op}: {rule}"


def test_kernel_worker_protocol_and_row_check(tmp_path):
    """The C2 kernel worker end to end without a GPU (its fake CPU kernels): a row-wise kernel
    passes the row check at sizes across 64 and 257, the planted split-K GEMM is caught at 64
    rows with both hex values (below 64 rows the fake's stock CPU GEMM varies too: it is only the
    protocol that is under test here), a kernel that re-rounds one row in 37 is caught although no
    probe row is among them, an unknown case comes back as a clear error, not a hang."""
    from fixtures.core.comparison import BitwiseMismatch
    dims = {"hidden": 64, "intermediate": 32, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 100,
            "experts": 0, "top_k": 0, "moe_intermediate": 0}
    worker = VKC.KernelWorker(batch_invariant=True, dims=dims, log_dir=tmp_path, fake="echo")
    try:
        assert worker.info["vllm"] == "fake" and worker.info["batch_invariant"]
        VKC.check_rows(worker, "rms_norm", [1, 7, 64, 257])
        with pytest.raises(BitwiseMismatch, match=r"(?s)row 0 of a 64-token call != row 0 alone.*0x"):
            VKC.check_rows(worker, "planted_split_k_from_64", [1, 64])
        with pytest.raises(BitwiseMismatch, match=r"(?s)row 11 of a 256-token call != row 11 alone.*"
                                                  r"rows_differing_from_alone: 7 of 256, 7 of 257"):
            VKC.check_rows(worker, "planted_rare_rows_from_256", [1, 7, 255, 256, 257])   # no probe row is hit
        with pytest.raises(VKC.KernelWorkerError, match="unknown kernel case 'nope'"):
            worker.run("nope", [1])
    finally:
        worker.close()
    assert worker.proc.poll() is not None


def test_profile_launches_on_cpu_leaves_no_hooks(tmp_path):
    """The profiler wrapper runs the call, names module classes, writes the trace and removes its
    global module hooks (no CUDA here: no kernel launches to list)."""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    calls = []
    launches, classes = VKI.profile_launches(lambda: calls.append(model(torch.ones(2, 4))), model,
                                            tmp_path / "t.json", phase="train-forward")
    assert calls and (tmp_path / "t.json").is_file() and launches == []
    assert classes == {"Sequential": ["<model>"], "Linear": ["0"], "ReLU": ["1"]}
    assert not torch.nn.modules.module._global_forward_pre_hooks and not torch.nn.modules.module._global_forward_hooks


def test_trainer_kernels_must_be_the_engines():
    engine = VKI.KernelInventory.from_launches(
        [VKI.Launch("matmul_kernel_persistent", "", "m", "Linear", "prefill"),
         VKI.Launch("_rms_norm_kernel", "", "n", "RMSNorm", "prefill")], model="e", settings={})
    same = VKI.KernelInventory.from_launches([VKI.Launch("matmul_kernel_persistent", "", "m", "Linear", "train-forward")],
                                            model="t", settings={})
    other = VKI.KernelInventory.from_launches(
        [VKI.Launch("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "aten::mm", "m", "Linear", "train-forward"),
         VKI.Launch("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "aten::add", "", "",
                   "train-forward")], model="t", settings={})
    assert VKI.engine_kernels_missing(same, engine) == []
    assert VKI.engine_kernels_missing(other, engine) == ["nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT"]
