"""The optional capabilities of fixtures.core.contract: how `isinstance(obj, Capability)` answers,
and which capabilities the built-in objects have - the reference stack's and the vLLM adapter's
(its engine through the fake worker, its engine-kernel trainer on the CPU with ReferenceOps) - so
the gates ask the same questions of them that they asked with hasattr, and get the same answers."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from fixtures.core import contract as C
from fixtures.models.proxies import build_proxy


# ---------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------
class _Recorder:
    module_naming = "vllm"

    def module_outputs(self, sequence):
        return []


class _Forwarding:
    """A wrapper that forwards attributes (as the planted-fault wrappers do)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, item):
        return getattr(self.inner, item)


class _Broken:
    @property
    def tensor_parallel_size(self):
        raise RuntimeError("closed")


def test_every_member_present_and_not_none():
    assert isinstance(_Recorder(), C.RecordsModuleOutputs)
    assert not isinstance(_Recorder(), C.RecordsModuleOutputsInBatch)      # one member short
    assert not isinstance(object(), C.RecordsModuleOutputs)
    blocked = _Recorder()
    blocked.module_outputs = None                                         # None blocks a capability
    assert not isinstance(blocked, C.RecordsModuleOutputs)
    assert not isinstance(types.SimpleNamespace(sampler=None), C.NamesSampler)
    assert isinstance(types.SimpleNamespace(sampler="v2"), C.NamesSampler)


def test_a_forwarding_wrapper_has_what_it_wraps():
    assert isinstance(_Forwarding(_Recorder()), C.RecordsModuleOutputs)
    assert not isinstance(_Forwarding(object()), C.RecordsModuleOutputs)


def test_a_member_that_cannot_answer_is_absent():
    assert not isinstance(_Broken(), C.HasTensorParallel)


def test_members_are_the_documented_ones():
    assert C.TrainsRL._capability_members == {"train_step", "weight_hashes", "export_weights"}
    assert C.ComputesAtTensorParallel._capability_members == {"at_tensor_parallel", "tensor_parallel_size"}
    assert C.RecordsModuleOutputsInBatch._capability_members == {"module_naming", "module_outputs",
                                                                 "module_outputs_in_batch"}
    assert C.HasKernelMode._capability_members == {"kernel_mode", "kernel_table"}


def _documented_rows() -> dict[str, tuple[str, str]]:
    """docs/capabilities.md's table: capability name -> (its "on" cell, its members cell)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "capabilities.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_the_capability_table_is_the_contract():
    """docs/capabilities.md, the one table of the optional capabilities, against the code: a row per
    capability and no other, its "on" cell the kinds of object the plugin asks it of, and every
    member the capability adds to its bases named in the members cell."""
    from fixtures.core import full_rows
    caps = {c.__name__: c for m in (C, full_rows) for c in vars(m).values()
            if isinstance(c, type) and C.Capability in c.__mro__[1:]}
    rows = _documented_rows()
    assert set(rows) == set(caps)
    kinds = {"engine": C.ENGINE_CAPABILITIES, "trainer": C.TRAINER_CAPABILITIES,
             "implementation": C.IMPLEMENTATION_CAPABILITIES}
    for name, cap in caps.items():
        on, members = rows[name]
        asked_of = {kind for kind, listed in kinds.items() if cap in listed}
        if asked_of:
            assert set(on.split(", ")) == asked_of, (name, on)
        inherited = set().union(*(b._capability_members for b in cap.__mro__[1:] if C.Capability in b.__mro__))
        assert [m for m in cap._capability_members - inherited if f"`{m}" not in members] == [], (name, members)


def test_the_base_implementation_has_no_optional_capability():
    class Bare(C.Implementation):
        def describe(self):
            return {}

        def make_trainer(self, model_dir):
            raise NotImplementedError
    assert C.capabilities_of(Bare(), C.IMPLEMENTATION_CAPABILITIES) == []


# ---------------------------------------------------------------------------------------------
# the reference stack
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_proxy("llama", "tiny", tmp_path_factory.mktemp("llama")).path


def test_reference_capabilities(llama_dir):
    from fixtures.reference.implementation import ReferenceImplementation
    impl = ReferenceImplementation()
    assert C.capabilities_of(impl, C.IMPLEMENTATION_CAPABILITIES) == ["HasKernelMode", "ProvidesKernels"]
    from fixtures.reference.kernels import KERNELS
    assert impl.kernel_library() is KERNELS            # the live registry: a planted kernel fault is what C2 sees
    with impl.kernel_mode() as mode:
        assert isinstance(mode, C.CountsServedOps)
    trainer = impl.make_trainer(llama_dir)
    assert C.capabilities_of(trainer, C.TRAINER_CAPABILITIES) == ["TrainsRL", "LogprobsWithGrad", "DeclaresOptimizer",
                                                                   "RunsUnderKernelMode"]
    with impl.make_engine(llama_dir) as engine:
        assert C.capabilities_of(engine, C.ENGINE_CAPABILITIES) == ["ResetsPrefixCache", "RecordsRows",
                                                                     "ExposesModule"]
    trainer.close()


# ---------------------------------------------------------------------------------------------
# the vLLM adapter (no vLLM, no GPU: fake worker, ReferenceOps on the CPU)
# ---------------------------------------------------------------------------------------------
def test_vllm_implementation_capabilities():
    from fixtures.vllm.implementation import VLLMImplementation
    ref = VLLMImplementation(fake="echo", max_idle=0)
    assert C.capabilities_of(ref, C.IMPLEMENTATION_CAPABILITIES) == ["HasKernelMode", "ProvidesKernels",
                                                                     "ChecksEngineKernels"]
    # the engine-kernel trainer runs vLLM's kernels (ChecksEngineKernels), not the reference ones: C2 on those
    # would judge kernels nothing in the stack runs
    ek = VLLMImplementation(fake="echo", max_idle=0, trainer="engine-kernels")
    assert C.capabilities_of(ek, C.IMPLEMENTATION_CAPABILITIES) == ["ChecksEngineKernels", "ConfiguresProcess"]
    lib = ref.engine_kernel_library()
    assert lib.rule_cases() <= set(lib.cases)
    dense = lib.dims({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100})
    assert "fused_moe" not in lib.cases_for(dense) and "linear" in lib.cases_for(dense)
    assert not any(lib.cases[c].planted for c in lib.cases_for(dense))


def test_vllm_engine_capabilities(tmp_path):
    from fixtures.vllm.implementation import VLLMImplementation
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    impl = VLLMImplementation(fake="echo", max_idle=0)
    with impl.make_engine(d) as lease:
        have = C.capabilities_of(lease, C.ENGINE_CAPABILITIES)
        assert have == ["ResetsPrefixCache", "RecordsRows", "RecordsModuleOutputs", "InventoriesKernels",
                        "HasTensorParallel", "ReportsKVCache"], have       # the fake worker's runner is no V1/V2: names no sampler
        assert lease.tensor_parallel_size == 1 and lease.module_naming == "vllm" and lease.sampler is None
    impl.pool.close_all()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_proxy("qwen3", "tiny", tmp_path_factory.mktemp("qwen3")).path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_proxy("qwen3_moe", "tiny", tmp_path_factory.mktemp("moe")).path


def test_engine_kernel_trainer_capabilities(qwen3_dir):
    from fixtures.vllm import trainer as VT
    from fixtures.vllm import trainer_ops as VO
    trainer = VT.EngineKernelTrainer(qwen3_dir, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    have = C.capabilities_of(trainer, C.TRAINER_CAPABILITIES)
    assert have == ["TrainsRL", "LogprobsWithGrad", "DeclaresOptimizer", "RecordsModuleOutputs",
                    "RecordsModuleOutputsInBatch",
                    "RunsEngineKernels", "DeclaresBackwards", "HasTensorParallel", "ComputesAtTensorParallel", "RunsUnderKernelMode",
                    "PlantsULP"], have                   # ReferenceOps names no sampler
    trainer.ops = types.SimpleNamespace(sampler="v2", name="x")
    assert isinstance(trainer, C.NamesSampler) and trainer.sampler == "v2"


@pytest.mark.parametrize("which", ["qwen3", "moe"])
def test_c7_planted_ulp_control_through_the_capability(which, qwen3_dir, moe_dir):
    """Gate C7's planted-ULP control, run as the gate runs it, on the engine-kernel trainer:
    planted_ulp() names the point the comparison must find first (SiLU-and-mul of a dense first
    layer, o_proj of an MoE one), and the ops provider is restored afterwards."""
    import tests_c8_training.test_c7_parity as C7
    from fixtures.vllm import trainer as VT
    from fixtures.vllm import trainer_ops as VO
    trainer = VT.EngineKernelTrainer(qwen3_dir if which == "qwen3" else moe_dir, VO.ReferenceOps,
                                     dtype=torch.float32, device="cpu")
    ops = trainer.ops
    C7.test_control_planted_ulp_is_named(trainer, types.SimpleNamespace(config=trainer.model.config))
    assert trainer.ops is ops
    with trainer.planted_ulp() as point:
        assert isinstance(trainer.ops, VO.PlantedULP)
    assert point == ("model.layers.0.mlp.act_fn" if which == "qwen3" else "model.layers.0.self_attn.o_proj")
    with pytest.raises(NotImplementedError, match="n/a"):
        with trainer.planted_ulp("rotary", 3):
            pass
