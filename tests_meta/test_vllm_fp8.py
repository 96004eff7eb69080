"""--vllm-quantization fp8 on the CPU (issue #47 item 3): the option's value check, the engines'
LLM(quantization="fp8") and their own engine key, the run header's / describe()'s line, every trainer
check n/a with one line (the gates that need the trainer read incomplete, never pass, never fail), the
C0 kernel table's FP8 rules, and C2's FP8 row check (fixtures.vllm.fp8_rows) on the fake kernel
worker's CPU twins: the dense FP8 linear and the FP8 fused MoE green at 1 ... 4096 rows, the planted
per-tensor activation scale red. vLLM's real FP8 kernels run only on a GPU: not yet run on a GPU."""
from __future__ import annotations

import json

import pytest
import torch

from fixtures.core.comparison import BitwiseMismatch
from fixtures.core.contract import EngineSettings, Request, SamplingParams
from fixtures.core.outcomes import Skipped, not_available
from fixtures.core.verdicts import CheckRecord, gate_verdicts
from fixtures.plugin.options import VLLM_KNOBS, _quantization
from fixtures.vllm import client as vclient
from fixtures.vllm import fp8_rows as F8
from fixtures.vllm import kernel_cases as VKC
from fixtures.vllm import kernel_inventory as VKI
from fixtures.vllm import settings as vset
from fixtures.vllm.implementation import QUANTIZATION_ENV, VLLMImplementation
from fixtures.vllm.kernel_library import VLLMKernelLibrary

DENSE = dict(hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=100, experts=0, top_k=0,
             moe_intermediate=0)
MOE = dict(DENSE, experts=4, top_k=2, moe_intermediate=16)
FP8 = vset.AdapterDefaults(quantization="fp8")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    return d


# ---------------------------------------------------------------------------------------------
# the option, the engines' arguments, the engine key
# ---------------------------------------------------------------------------------------------
def test_the_option_takes_fp8_only():
    knob = next(k for k in VLLM_KNOBS if k.name == "quantization")
    assert (knob.flag, knob.env, knob.runtime) == ("--vllm-quantization", QUANTIZATION_ENV, False)
    assert _quantization(" FP8 ") == "fp8"
    for bad in ("int8", "", "none", "fp8,int8"):
        with pytest.raises(ValueError, match="expected fp8"):
            _quantization(bad)


def test_every_engine_asks_vllm_for_online_fp8_and_keys_apart(model_dir):
    plain, fp8 = vset.llm_kwargs(model_dir, EngineSettings()), vset.llm_kwargs(model_dir, EngineSettings(), FP8)
    assert "quantization" not in plain and fp8["quantization"] == "fp8"
    assert fp8["dtype"] == "bfloat16", "online FP8: the checkpoint stays bf16, vLLM quantizes at load"
    for settings in (EngineSettings(), EngineSettings(batch_invariant=False), EngineSettings(max_num_seqs=3)):
        assert vset.engine_key(model_dir, settings) != vset.engine_key(model_dir, settings, FP8)
    assert "quantization=fp8" in FP8.describe()


def test_vllm_resolving_another_quantization_is_a_mismatch():
    eff = vset.effective_settings(EngineSettings(), FP8)
    info = {k: eff[k] for k in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling",
                                "max_num_seqs", "max_num_batched_tokens", "batch_invariant")}
    assert vset.resolution_mismatches(eff, {**info, "quantization": "fp8"}) == []
    assert vset.resolution_mismatches(eff, {**info, "quantization": None}) == \
        ["quantization: asked 'fp8', vLLM resolved None"]


def test_the_implementation_reads_the_option_and_its_engines_serve_fp8(model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv(QUANTIZATION_ENV, "fp8")
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path / "logs"))
    impl = VLLMImplementation(fake="echo", max_idle=0)
    assert impl.defaults.quantization == "fp8"
    assert impl.describe()["quantization"].startswith("fp8: every engine LLM(quantization='fp8')")
    with impl.make_engine(model_dir) as eng:
        info = eng._engine.info
        assert info["quantization"] == "fp8" and info["llm_kwargs"]["quantization"] == "fp8"
        inv = eng.kernel_inventory([Request("a", (1, 2, 3), SamplingParams(max_tokens=2))], model="fake")
    fp8 = inv.kernel_cases()["fp8_linear"]
    assert len(fp8) == 2 and any("cutlass" in k for k in fp8), inv.markdown()
    monkeypatch.delenv(QUANTIZATION_ENV)
    plain = VLLMImplementation(fake="echo", max_idle=0)
    assert plain.defaults.quantization is None and plain.describe()["quantization"] == "none (bf16 weights)"


# ---------------------------------------------------------------------------------------------
# the trainer: n/a with one line, the gates that need it incomplete
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, who", [("engine-kernels", "engine-kernel"), ("modules", "module-built"),
                                       ("reference-kernels", "reference-kernel (hf-transformers)")])
def test_every_trainer_check_is_na_with_one_line(kind, who, model_dir, monkeypatch):
    monkeypatch.setenv(QUANTIZATION_ENV, "fp8")
    impl = VLLMImplementation(fake="echo", max_idle=0, trainer=kind)
    with pytest.raises(NotImplementedError) as exc:
        impl.make_trainer(model_dir)
    with pytest.raises(Skipped) as skip:
        not_available(exc.value, "no trainer")                 # what conftest's trainer fixture does with it
    text = str(skip.value.msg)
    assert text == (f"n/a: the {who} trainer computes in bf16; the engine serves FP8 weights (--vllm-quantization "
                    f"fp8): train = engine cannot hold"), text
    assert "\n" not in text and dict(skip.value.properties)["outcome"] == "n/a"


def test_trainer_gates_read_incomplete_never_pass_never_fail():
    """C6-C9's defining checks n/a for the trainer: each such gate is incomplete, naming the reason."""
    why = "n/a: the engine-kernel trainer computes in bf16; the engine serves FP8 weights: train = engine cannot hold"
    results = [CheckRecord(f"tests_c8_training/x.py::{t}[m]", gate, "m", "skipped", why, kind="n/a")
               for gate, t in (("C6", "test_micro_batch_size"), ("C6", "test_position_and_composition"),
                               ("C7", "test_trainer_equals_engine"), ("C9", "test_two_rl_steps_stay_exactly_on_policy"))]
    verdicts = gate_verdicts(results, ["m"], ["C6", "C7", "C9"], chained=False)["m"]
    assert {g: v.status for g, v in verdicts.items()} == {"C6": "incomplete", "C7": "incomplete", "C9": "incomplete"}
    assert "the engine-kernel trainer computes in bf16" in verdicts["C7"].label()


# ---------------------------------------------------------------------------------------------
# C0: the FP8 kernels in the engine's kernel table
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, op, plain, fp8", [
    ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8>", "_C::cutlass_scaled_mm", "linear", "fp8_linear"),
    ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16>", "", None, "fp8_linear"),
    ("void vllm::segmented_max_reduction<c10::BFloat16>", "_C::dynamic_scaled_fp8_quant", None, "fp8_fused_moe"),
    ("fused_moe_kernel", "", "fused_moe", "fp8_fused_moe"),
    ("matmul_kernel_persistent", "", "linear", "linear"),          # the LM head stays bf16
])
def test_fp8_kernels_map_to_their_cases_only_when_served(kernel, op, plain, fp8):
    got = lambda rules: getattr(VKI.classify(kernel, op, rules), "case", None) or None   # noqa: E731
    assert (got(VKI.rules_for(None)), got(VKI.rules_for("fp8"))) == (plain, fp8)


def test_the_fp8_cases_apply_only_with_the_option():
    assert not {"fp8_linear", "fp8_fused_moe"} & set(VKC.cases_for(MOE))
    assert {"fp8_linear", "fp8_fused_moe"} <= set(VLLMKernelLibrary(quantization="fp8").cases_for(MOE))
    assert "fp8_fused_moe" not in VKC.cases_for(DENSE, "fp8") and "fp8_linear" in VKC.cases_for(DENSE, "fp8")
    assert {"fp8_linear", "fp8_fused_moe"} <= VLLMKernelLibrary().rule_cases() <= set(VKC.CASES)
    assert all(VKC.CASES[c].rows != "tokens" for c in F8.FP8_CASES), "not in the alone-row check (1100 rows)"


# ---------------------------------------------------------------------------------------------
# C2: the row check on the fake worker's CPU twins
# ---------------------------------------------------------------------------------------------
def test_the_e4m3_emulation_is_torchs_cast():
    x = torch.cat([torch.randn(4000) * s for s in (1e-3, 0.1, 1.0, 30.0, 300.0)] + [torch.tensor([448.0, -500.0, 0.0])])
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn to compare the emulation with")
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    saved = torch.float8_e4m3fn
    try:
        del torch.float8_e4m3fn
        emulated = F8.to_e4m3(x)
    finally:
        torch.float8_e4m3fn = saved
    assert torch.equal(emulated, ref)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log = tmp_path_factory.mktemp("fp8-logs")
    live = {name: VKC.KernelWorker(batch_invariant=True, dims=dims, log_dir=log, fake="echo")
            for name, dims in (("dense", DENSE), ("moe", MOE))}
    yield live
    for w in live.values():
        w.close()


def test_fp8_linear_rows_equal_the_largest_call(workers):
    out = VLLMKernelLibrary(fake="echo", quantization="fp8").check_fp8_rows(workers["dense"], "fp8_linear",
                                                                            F8.FP8_SIZES)
    assert set(out["shapes"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert all(r["largest"] == 4096 and set(r["differing"]) == set(F8.FP8_SIZES) for r in out["shapes"].values())
    assert "per-token dynamic FP8 quant" in out["kernel"]


def test_fp8_fused_moe_rows_equal_the_largest_call(workers):
    out = F8.check_fp8_rows(workers["moe"], "fp8_fused_moe", F8.FP8_SIZES)
    assert not any(out["shapes"]["experts"]["differing"].values())


def test_planted_per_tensor_activation_scale_is_red_naming_the_kernel(workers):
    with pytest.raises(BitwiseMismatch, match="rows_differing_from_largest") as exc:
        F8.check_fp8_rows(workers["dense"], "fp8_linear", F8.FP8_SIZES, variant=F8.PLANTED)
    assert "vLLM fp8_linear" in str(exc.value) and F8.PLANTED in str(exc.value)


def test_an_unknown_case_or_variant_is_refused(workers):
    with pytest.raises(VKC.KernelWorkerError, match="unknown FP8 variant"):
        F8.check_fp8_rows(workers["moe"], "fp8_fused_moe", [1, 2], variant=F8.PLANTED)
    with pytest.raises(VKC.KernelWorkerError, match="outside 1..4096"):
        F8.check_fp8_rows(workers["dense"], "fp8_linear", [1, 5000])
