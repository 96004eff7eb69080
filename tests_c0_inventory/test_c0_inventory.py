"""Gate C0 - Inventory: every module class and aten op reached in prefill, decode and backward is
listed and mapped to a kernel policy; zero unmapped ops. Artifact: inventory JSON + Markdown."""
from __future__ import annotations

import pytest

from fixtures.checks.inventory import PHASES, kernel_table_problems
from fixtures.core.contract import HasKernelMode
from fixtures.core.outcomes import not_applicable

pytestmark = pytest.mark.C0


def test_every_phase_traced(inventory):
    """An inventory that missed a phase would map nothing it never saw."""
    seen = inventory.phases_seen()
    assert seen == set(PHASES), f"phases traced: {sorted(seen)}; expected {list(PHASES)}"


def test_no_unmapped_op(inventory):
    unmapped = inventory.unmapped
    assert not unmapped, (
        f"{len(unmapped)} aten op(s) reached by {inventory.model} have no kernel policy "
        "(add each to the implementation's kernel table with a batch-invariant kernel, or classify it "
        "as elementwise / data movement):\n" + "\n".join(
            f"  {e.op}: first in module {e.first_module} ({', '.join(sorted(e.module_classes)) or 'outside'}), "
            f"phases {', '.join(sorted(e.phases))}, {e.count} calls" for e in unmapped))


def test_every_module_class_listed(inventory, trainer):
    """Each module class that ran an op appears with its ops, all mapped."""
    classes = {type(m).__name__ for m in trainer.module().modules()}
    reached = set(inventory.module_classes)
    assert reached, "no module class reached any op"
    unknown = reached - classes - {""}
    assert not unknown, f"inventory names classes the model does not have: {sorted(unknown)}"
    bad = {c: sorted(o for o in ops if inventory.ops[o].policy is None)
           for c, ops in inventory.module_classes.items()}
    bad = {c: o for c, o in bad.items() if o}
    assert not bad, f"module classes with unmapped ops: {bad}"


def test_kernel_table_both_ways(inventory, impl):
    """The kernel table checked against what the kernel mode really dispatched, both ways: every
    kernel the table claims for an op the model reaches was dispatched for it, and no KERNEL-policy
    op ran stock (slipped through the mode)."""
    if not isinstance(impl, HasKernelMode):
        not_applicable(f"the implementation is not HasKernelMode ({impl.name} has no kernel_mode(): nothing says "
                       "which kernel served an op, so the kernel table cannot be checked against what was really "
                       "dispatched; see fixtures.reference.implementation.ReferenceImplementation)",
                       capability=HasKernelMode)
    if not inventory.kernel_mode:
        pytest.fail(f"{impl.name}: kernel_mode() returned no context manager (HasKernelMode: a fresh mode per call, "
                    "under which its kernels serve every op)")
    if not inventory.served and not inventory.unserved:
        pytest.fail(f"{inventory.kernel_mode} reported nothing served: it must count served ops as "
                    "`served_ops: Counter[(op, kernel)]` and `passed_through: Counter[op]` (fixtures.reference.invariant_mode)")
    problems, notes = kernel_table_problems(inventory)
    assert not problems, (
        f"kernel table vs kernel mode ({inventory.kernel_mode}) for {inventory.model}: {len(problems)} problem(s)\n  "
        + "\n  ".join(problems) + ("\n notes:\n  " + "\n  ".join(notes) if notes else ""))
