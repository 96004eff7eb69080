"""tests_meta/ mirrors fixtures/: every library module has a self-test a reader can find from its
name - a tests_meta module that imports it or names it (`fixtures.pkg.module`, in its code or its
docstring) - or is in NO_SELF_TEST below with the reason it has none of its own. A new library
module without either fails here. tests_meta/README.md holds the table (library module -> its
self-test modules); `python tests_meta/test_mirror.py` prints it from the same scan.

Read from the source with `ast` and plain text (nothing is imported): fast, and a module that
fails to import still gets its row."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG, TESTS = ROOT / "fixtures", ROOT / "tests_meta"
# These name library modules as rules about the tree, not as the modules' tests.
NOT_A_MIRROR = {"test_architecture.py", "test_mirror.py"}

# Library modules with no self-test module of their own, each with the reason. They are run, every
# one, by the gate modules on the reference stack in the CPU lane (tests_c*/) and by the fault
# matrix (tests_meta/test_fault_matrix.py: each planted fault must fail its gate), or by the GPU lane.
_C2_C4 = "a C2 / C4 check body, run by tests_c5_invariance/ on the reference stack; the fault matrix proves it fails"
_C8 = "a part of C8's gradient checks, run through fixtures.checks.grad_checks (tests_meta/test_grad_checks.py)"
_FAULT = "a part of the fault catalog, every fault of which tests_meta/test_fault_matrix.py plants (via fixtures.faults.catalog)"
_HOOKS = "plugin hooks, run by every pytester inner suite (tests_meta/test_plugin.py, test_gate_records.py, test_outcomes.py)"
_REF = "a part of the reference stack, run through fixtures.reference.engine / hf_trainer in every CPU-lane check and tests_meta/test_selftest.py"
_VLLM = "does its work only with vLLM on a GPU (the GPU lane: the gate modules with --impl vllm); the fake backend's worker does not exercise it"
NO_SELF_TEST = {
    "fixtures.checks.backward_probes": _C8,
    "fixtures.checks.controls": "C6/C7/C9's negative controls, called by the gate modules (tests_c8_training/) on the reference stack",
    "fixtures.checks.full_row_checks": _C2_C4,
    "fixtures.checks.kernel_cases": _C2_C4,
    "fixtures.checks.planted_backwards": _C8,
    "fixtures.checks.row_checks": _C2_C4,
    "fixtures.checks.sequence_checks": _C2_C4,
    "fixtures.checks.stock_kernels": _C2_C4,
    "fixtures.checks.strategies": "the hypothesis strategies the C2 / C4 / C8 checks draw from; run with those checks",
    "fixtures.checks.train_forward": _C8,
    "fixtures.diagnose.engine_ops": "the per-op part of fixtures.diagnose.engine_rows, run when an engine check fails (tests_meta/test_localise.py)",
    "fixtures.faults.base": _FAULT,
    "fixtures.faults.conventions": _FAULT + "; diagnosed in tests_meta/test_conventions.py",
    "fixtures.faults.engine_faults": _FAULT,
    "fixtures.faults.trainer_faults": _FAULT,
    "fixtures.models.seeded_inputs": "seeded token ids and C0's fixed workload, drawn by every CPU-lane check (tests_c*/)",
    "fixtures.plugin.collection": _HOOKS,
    "fixtures.plugin.records": _HOOKS,
    "fixtures.plugin.summary": _HOOKS,
    "fixtures.reference.engine_outputs": _REF,
    "fixtures.reference.hf_attention": _REF,
    "fixtures.vllm.engine_probes": _VLLM,
    "fixtures.vllm.kernel_worker": "the C2 kernel worker child (`python -m`), started by fixtures.vllm.kernel_cases "
                                   "(tests_meta/test_vllm_kernels.py) with vLLM on a GPU",
    "fixtures.vllm.request_rows": _VLLM,
    "fixtures.vllm.spares": "the vLLM pool's spare worker processes, run by tests_meta/test_worker_warmup.py and test_vllm_adapter.py through fixtures.vllm.pool and the fake backend",
    "fixtures.vllm.zygote": "the forked-worker zygote (--vllm-runtime fork-workers=1), run through fixtures.vllm.implementation in tests_meta/test_vllm_adapter.py",
}


def library_modules() -> list[str]:
    """Every module of fixtures/ but the packages' __init__ (recipes and families are data, not .py)."""
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                  for p in PKG.rglob("*.py") if p.name != "__init__.py")


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def mirror() -> dict[str, list[str]]:
    """library module -> the tests_meta modules that import it or name it."""
    modules = library_modules()
    table: dict[str, list[str]] = {m: [] for m in modules}
    for test in sorted(TESTS.glob("*.py")):
        if test.name in NOT_A_MIRROR:
            continue
        text = test.read_text()
        imported = _imports(ast.parse(text, str(test)))
        named = set(re.findall(r"\bfixtures(?:\.\w+)+", text))
        for m in modules:
            if m in imported or m in named:
                table[m].append(test.name)
    return table


def test_every_library_module_has_a_self_test_or_a_stated_reason():
    table = mirror()
    missing = [m for m, tests in table.items() if not tests and m not in NO_SELF_TEST]
    assert missing == [], ("library modules no tests_meta module imports or names: add a self-test "
                           "(tests_meta/test_<module>.py) or a NO_SELF_TEST entry with the reason")
    # The allow-list does not rot: a module it lists still exists and still has no self-test.
    stale = [m for m in NO_SELF_TEST if m not in table or table[m]]
    assert stale == [], "NO_SELF_TEST lists modules that are gone or now have a self-test: remove them"


def test_the_readme_table_has_a_row_for_every_library_module():
    """tests_meta/README.md's table names every library module (its test lists may lag a little;
    `python tests_meta/test_mirror.py` prints them fresh)."""
    readme = (TESTS / "README.md").read_text()
    rows = set(re.findall(r"^\| `(fixtures[\w.]+)`", readme, re.M))
    assert sorted(set(library_modules()) - rows) == [] and sorted(rows - set(library_modules())) == []


def test_the_scan_sees_an_import_and_a_name(tmp_path, monkeypatch):
    """Negative control: a module nobody imports or names is reported, and naming it is enough."""
    pkg, tests = tmp_path / "fixtures" / "pkg", tmp_path / "tests_meta"
    pkg.mkdir(parents=True)
    tests.mkdir()
    for name in ("__init__", "seen", "named", "orphan"):
        (pkg / f"{name}.py").write_text("")
    (tests / "test_a.py").write_text("from fixtures.pkg import seen\n")
    (tests / "test_b.py").write_text('"""Tests fixtures.pkg.named."""\n')
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PKG", tmp_path / "fixtures")
    monkeypatch.setitem(globals(), "TESTS", tests)
    assert mirror() == {"fixtures.pkg.named": ["test_b.py"], "fixtures.pkg.orphan": [],
                        "fixtures.pkg.seen": ["test_a.py"]}


if __name__ == "__main__":
    print("| library module | self-test module(s) |\n|---|---|")
    for module, tests in mirror().items():
        cell = ", ".join(f"[{t}]({t})" for t in tests) or f"none of its own: {NO_SELF_TEST.get(module, '?')}"
        print(f"| `{module}` | {cell} |")
