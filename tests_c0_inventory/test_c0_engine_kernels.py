"""Gate C0 for the engine's own kernels (engines that expose `kernel_inventory`, i.e. vLLM): every
CUDA kernel the engine launches for a prefill + decode + sampling workload is listed with the op,
module class and phase that launched it, and mapped by fixtures.vllm.kernels.RULES to a policy;
zero unmapped kernels, and every reduction kernel names a C2 case that tests_c5_invariance/
test_c2_vllm_kernels.py runs on that kernel. Artifact: engine-kernels-<model>.json / .md.

Engines without the method (the reference engine runs the trainer's kernels, inventoried by
test_c0_inventory.py) skip with "n/a".
"""
from __future__ import annotations

import json
import re

import pytest

from fixtures.vllm import kernels as VK

pytestmark = pytest.mark.C0


@pytest.fixture(scope="module")
def engine_kernels(engine_kernel_inventory):
    return engine_kernel_inventory


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
        "fixtures.vllm.kernels.RULES (map each to a C2 case if it reduces, else elementwise / data movement):\n"
        + "\n".join(f"  {e.kernel}\n      ops {sorted(e.ops) or ['(bare launch)']}, module {e.first_module or '(outside)'} "
                    f"({', '.join(sorted(e.module_classes)) or '-'}), phases {sorted(e.phases)}, {e.count} launches"
                    for e in unmapped[:25]))


def test_every_reduction_kernel_has_a_c2_case(engine_kernels, proxy):
    """Claims checked both ways: each KERNEL-policy kernel the engine ran names a C2 case that
    exists and runs for this model; the cases the model reached are listed in the artifact."""
    cases = engine_kernels.kernel_cases()
    assert cases, "no reduction kernel found in the engine's launches: a GEMM at least must be there"
    unknown = {c: k for c, k in cases.items() if c not in VK.CASES}
    assert not unknown, f"kernel table names C2 cases that do not exist: {unknown}"
    dims = VK.dims_from_config(json.loads((proxy.path / "config.json").read_text()))
    inapplicable = {c: k for c, k in cases.items() if c not in VK.cases_for(dims)}
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



def test_trainer_forward_runs_the_engine_kernels(engine_kernels, trainer, proxy, model_name, artifact_dir, tmp_path):
    """A trainer that claims the engine's arithmetic (it exposes `kernel_inventory`, as the
    engine-kernel trainer does) launches in its forward only reduction kernels the engine
    launched too, every one mapped: the claim behind C7, checked kernel by kernel."""
    take = getattr(trainer, "kernel_inventory", None)
    if take is None:
        pytest.skip("n/a: the trainer exposes no kernel_inventory (it runs its own kernels; C7 compares the bits)")
    from fixtures.plugin.session import model_id
    from fixtures.vllm.kernels import inventory_workload
    inv = take([r.prompt_ids for r in inventory_workload(proxy.config.vocab_size)], tmp_path / "trainer.trace.json")
    (artifact_dir / f"trainer-kernels-{model_id(model_name)}.md").write_text(inv.markdown())
    assert inv.launches > 0, "the trainer's forward launched no kernel under the profiler"
    assert not inv.unmapped, f"trainer kernels with no policy: {[e.kernel for e in inv.unmapped]}"
    missing = VK.engine_kernels_missing(inv, engine_kernels)
    assert not missing, (f"{len(missing)} reduction kernel(s) in the trainer's forward that the engine never launched "
                         f"for {engine_kernels.model}:\n  " + "\n  ".join(missing))
