"""Gate C0 for the engine's own kernels (an engine that is InventoriesKernels, i.e. vLLM): every
CUDA kernel the engine launches for a prefill + decode + sampling workload is listed with the op,
module class and phase that launched it, and mapped by the engine's kernel rules (for vLLM
fixtures.vllm.kernel_inventory.RULES) to a policy; zero unmapped kernels, and every reduction
kernel names a C2 case of the implementation's engine kernel library (ChecksEngineKernels) that
tests_c5_invariance/test_c2_vllm_kernels.py runs on that kernel. Artifact:
engine-kernels-<model>.json / .md.

Other engines (the reference engine runs the trainer's kernels, inventoried by
test_c0_inventory.py) are "n/a", naming the capability.
"""
from __future__ import annotations

import json
import re

import pytest

from fixtures.models.seeded_inputs import kernel_inventory_workload
from fixtures.core.contract import ChecksEngineKernels, RunsEngineKernels
from fixtures.core.outcomes import not_applicable
from fixtures.runtime.scheduling import ENGINE_KERNEL_SETUP

pytestmark = [pytest.mark.C0, pytest.mark.shared_setup(ENGINE_KERNEL_SETUP)]


@pytest.fixture(scope="module")
def engine_kernels(engine_kernel_inventory):
    return engine_kernel_inventory


@pytest.fixture(scope="module")
def library(impl):
    """The implementation's engine kernel library (ChecksEngineKernels): the C2 cases it checks."""
    if not isinstance(impl, ChecksEngineKernels):
        not_applicable(f"the implementation is not ChecksEngineKernels ({impl.name} names no C2 cases for its "
                       "engine's kernels)", capability=ChecksEngineKernels)
    return impl.engine_kernel_library()


def test_engine_kernels_traced(engine_kernels):
    """An inventory that saw no prefill or no decode step would map nothing it never ran."""
    assert engine_kernels.launches > 0, f"no kernel launch recorded: {engine_kernels.info}"
    phases = engine_kernels.phases_seen()
    assert {"prefill", "decode"} <= phases, (f"phases with kernels: {sorted(phases)}; expected prefill and decode "
                                             f"(steps {engine_kernels.info.get('steps')})")
    classes = {c for e in engine_kernels.entries.values() for c in e.module_classes}
    assert classes, "no kernel was attributed to a module: the module ranges did not reach the trace"


def test_no_unmapped_engine_kernel(engine_kernels):
    unmapped = engine_kernels.unmapped
    assert not unmapped, (
        f"{len(unmapped)} kernel(s) launched by the engine for {engine_kernels.model} have no policy in "
        "the engine's kernel rules (vLLM: fixtures.vllm.kernel_inventory.RULES; map each to a C2 case if it reduces, "
        "else elementwise / data movement):\n"
        + "\n".join(f"  {e.kernel}\n      ops {sorted(e.ops) or ['(bare launch)']}, module {e.first_module or '(outside)'} "
                    f"({', '.join(sorted(e.module_classes)) or '-'}), phases {sorted(e.phases)}, {e.count} launches"
                    for e in unmapped[:25]))


def test_every_reduction_kernel_has_a_c2_case(engine_kernels, library, proxy):
    """Claims checked both ways: each KERNEL-policy kernel the engine ran names a C2 case that
    exists and runs for this model; the cases the model reached are listed in the artifact."""
    cases = engine_kernels.kernel_cases()
    assert cases, "no reduction kernel found in the engine's launches: a GEMM at least must be there"
    unknown = {c: k for c, k in cases.items() if c not in library.cases}
    assert not unknown, f"kernel table names C2 cases that do not exist: {unknown}"
    dims = library.dims(json.loads((proxy.path / "config.json").read_text()))
    inapplicable = {c: k for c, k in cases.items() if c not in library.cases_for(dims)}
    assert not inapplicable, f"kernels mapped to C2 cases that do not run for this model: {inapplicable}"


def test_engine_attention_is_the_declared_backend(engine_kernels):
    """The attention kernels the engine launched are the backend it reported (FA3 for
    FLASH_ATTN): C2 checks that kernel, so a silent fallback must not pass unnoticed."""
    backends = engine_kernels.info.get("attention_backends") or []
    attn = [k for k, e in engine_kernels.entries.items() if e.rule is not None and e.rule.case == "attention"]
    assert attn, f"no attention kernel among the launches (backends reported: {backends})"
    expected = {"FLASH_ATTN": r"flash|Flash|fmha", "TRITON_ATTN": r"unified_attention"}
    for backend, pattern in expected.items():
        if any(backend in b for b in backends):
            assert any(re.search(pattern, k) for k in attn), (
                f"backend {backends} reported, but the attention kernels launched were: {attn}")



def test_trainer_forward_runs_the_engine_kernels(engine_kernels, trainer, impl, proxy, model_name, artifact_dir,
                                                 tmp_path):
    """A trainer that claims the engine's arithmetic (it is RunsEngineKernels, as the engine-kernel
    trainer is) launches in its forward only reduction kernels the engine launched too, every one
    mapped: the claim behind C7, checked kernel by kernel."""
    if not isinstance(trainer, RunsEngineKernels):
        not_applicable("the trainer is not RunsEngineKernels (it runs its own kernels; C7 compares the bits)",
                       capability=RunsEngineKernels)
    if not isinstance(impl, ChecksEngineKernels):
        not_applicable(f"the implementation is not ChecksEngineKernels ({impl.name} cannot say which of the "
                       "trainer's kernels are reductions the engine must launch too)", capability=ChecksEngineKernels)
    from fixtures.plugin.collection import model_id
    inv = trainer.kernel_inventory([r.prompt_ids for r in kernel_inventory_workload(proxy.config.vocab_size)],
                                   tmp_path / "trainer.trace.json")
    (artifact_dir / f"trainer-kernels-{model_id(model_name)}.md").write_text(inv.markdown())
    assert inv.launches > 0, "the trainer's forward launched no kernel under the profiler"
    assert not inv.unmapped, f"trainer kernels with no policy: {[e.kernel for e in inv.unmapped]}"
    missing = impl.engine_kernel_library().kernels_missing(inv, engine_kernels)
    assert not missing, (f"{len(missing)} reduction kernel(s) in the trainer's forward that the engine never launched "
                         f"for {engine_kernels.model}:\n  " + "\n  ".join(missing))
