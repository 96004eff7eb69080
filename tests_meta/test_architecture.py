"""The house stays as built (docs/architecture.md): no import cycle inside fixtures/, no _private
name imported across modules, the gates never import an engine's package, packages import only
the layers below them, and a module stays short unless it is one idea.

The layer rules that matter most: `core` (the contract and the judgement) imports nothing of the
suite - how a run is carried out never changes what a verdict means; `runtime` (the run machinery)
imports only core, so the machinery cannot reach into the plugin, the checks or an engine;
`vllm` never imports `checks` - an engine's package does not depend on the judge that grades it.

Read from the source with `ast` (nothing is imported), so a violation names file and line."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fixtures"
GATE_DIRS = ("tests_c0_inventory", "tests_c5_invariance", "tests_c8_training", "tests_c10_delivery")

# Which packages each package may import (besides itself). The layers, bottom up: core; runtime;
# models; diagnose; reference; checks; faults / vllm / records; plugin. docs/architecture.md says why.
MAY_IMPORT = {
    "core": set(),
    "runtime": {"core"},
    "models": {"core", "runtime"},
    "diagnose": {"core", "runtime", "models"},
    "reference": {"core", "runtime", "models", "diagnose"},
    "checks": {"core", "runtime", "models", "diagnose", "reference"},
    "faults": {"core", "runtime", "models", "diagnose", "reference", "checks"},
    "vllm": {"core", "runtime", "models", "diagnose", "reference"},
    "records": {"core", "models", "diagnose", "reference", "checks"},   # never plugin, never vllm
    "plugin": {"core", "runtime", "models", "diagnose", "reference", "checks", "faults", "records"},
}
# What the gate modules (and the root conftest.py) may import: the contract, the checks, the
# diagnosis tools, the proxies, the records lane and the run machinery (costs, GPU memory, the
# device alone); an engine's or a trainer's own package never.
GATE_MAY_IMPORT = {"core", "runtime", "checks", "diagnose", "models", "plugin", "records"}
MAX_LINES = 600
ONE_IDEA = {   # longer modules, each one idea that would only be scattered by a split
    "fixtures/reference/kernels.py": "the batch-invariant kernel library: one kernel family per section",
    "fixtures/core/contract.py": "the whole contract a third party implements, read in one place (its docstrings are it)",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]):
    """(line, imported fixtures module, imported names) for every import, lazy ones included."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fixtures"):
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("fixtures"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:                       # `from fixtures.core import contract`
                    yield node.lineno, full, []
                else:
                    yield node.lineno, base, [a.name]


def _graph():
    modules = _modules()
    return modules, {m: {imp for _, imp, _ in _imports(p, modules) if imp in modules and imp != m}
                     for m, p in modules.items()}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else None


def test_no_import_cycle_in_fixtures():
    _, graph = _graph()
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles (lazy imports count):\n  " + "\n  ".join(cycles)


def test_packages_import_only_the_layers_below():
    modules, _ = _graph()
    bad = []
    for m, path in modules.items():
        own = _package(m)
        if own is None:
            continue
        for line, imp, _ in _imports(path, modules):
            other = _package(imp)
            if other and other != own and other not in MAY_IMPORT[own]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {imp} ({other})")
    assert not bad, "layering violations (see MAY_IMPORT / docs/architecture.md):\n  " + "\n  ".join(bad)


def _private_uses(path: Path, modules: dict[str, Path]):
    here = _module_name(path)
    for line, imp, names in _imports(path, modules):
        for n in names:
            if n.startswith("_") and not n.startswith("__") and imp != here:
                yield f"{path.relative_to(ROOT)}:{line}: imports {imp}.{n}"
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fixtures"):
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fixtures") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and aliases[node.value.id] != here):
            yield f"{path.relative_to(ROOT)}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}"


def test_no_private_name_crosses_a_module():
    modules = _modules()
    bad = [u for p in modules.values() for u in _private_uses(p, modules)]
    assert not bad, "private names used outside their module (make them public or move the code):\n  " + \
        "\n  ".join(bad)


# A worker child (`python -m <child>`) never imports its parent's side, not even through another
# module: what both sides share lives below them (fixtures/vllm/ipc.py, convert.py).
CHILD_NEVER_IMPORTS = {
    "fixtures.vllm.worker": {"fixtures.vllm.client", "fixtures.vllm.pool", "fixtures.vllm.implementation"},
    "fixtures.vllm.kernel_worker": {"fixtures.vllm.kernel_cases", "fixtures.vllm.client"},
    "fixtures.vllm.zygote": {"fixtures.vllm.client", "fixtures.vllm.pool", "fixtures.vllm.spares",
                             "fixtures.vllm.implementation"},
}


def test_worker_children_never_import_their_parents():
    _, graph = _graph()
    bad = []
    for child, parents in CHILD_NEVER_IMPORTS.items():
        seen, todo = set(), [child]
        while todo:
            for d in graph.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        bad += [f"{child} reaches {p}" for p in sorted(seen & parents)]
    assert not bad, "a worker child imports its parent's side:\n  " + "\n  ".join(bad)


def _gate_files():
    return [ROOT / "conftest.py"] + sorted(p for d in GATE_DIRS for p in (ROOT / d).glob("*.py"))


@pytest.mark.parametrize("path", _gate_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_gate_modules_import_no_engine_package(path):
    modules = _modules()
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {imp}" for line, imp, _ in _imports(path, modules)
           if _package(imp) not in GATE_MAY_IMPORT]
    assert not bad, ("a gate asks the implementation for a capability (fixtures.core.contract) instead of "
                     "importing an engine's or trainer's package:\n  " + "\n  ".join(bad))


def test_modules_stay_short_unless_one_idea():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = {k: n for k, n in long.items() if k not in ONE_IDEA}
    assert not unexplained, f"modules over {MAX_LINES} lines: {unexplained}"
    stale = [k for k in ONE_IDEA if k not in long]
    assert not stale, f"ONE_IDEA entries no longer over {MAX_LINES} lines: {stale}"


def test_nothing_points_outside_the_repository():
    """A user has no ../shared: the spec lives in docs/gates.md, the GPU lane installs vLLM with pip."""
    bad = []
    for p in [*PKG.rglob("*.py"), *ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *_gate_files(),
              *(ROOT / "tests_meta").glob("*.py"), *(ROOT / "scripts").glob("*.sh"),
              *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")]:
        if p == Path(__file__).resolve():
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if "../shared" in line or "GATES.md" in line:
                bad.append(f"{p.relative_to(ROOT)}:{n}")
    assert not bad, "references to files a user does not have:\n  " + "\n  ".join(bad)


def test_the_checker_sees_a_planted_cycle_and_private_import(tmp_path, monkeypatch):
    """The negative control: a planted cycle and a planted private import are found."""
    global ROOT, PKG
    pkg = tmp_path / "fixtures"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from fixtures.core import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from fixtures.core.a import _hidden\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["PKG"]), "PKG", pkg)
    with pytest.raises(AssertionError, match="fixtures.core.a -> fixtures.core.b -> fixtures.core.a"):
        test_no_import_cycle_in_fixtures()
    with pytest.raises(AssertionError, match="imports fixtures.core.a._hidden"):
        test_no_private_name_crosses_a_module()


def test_every_package_has_a_layer_and_the_stated_rules_hold():
    """A package missing from MAY_IMPORT escapes the layering check; the rules of the module's
    docstring are pinned here so that widening MAY_IMPORT is a visible decision."""
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(MAY_IMPORT), f"packages without a layer: {packages - set(MAY_IMPORT)}; " \
                                        f"layers without a package: {set(MAY_IMPORT) - packages}"
    assert MAY_IMPORT["core"] == set()
    assert MAY_IMPORT["runtime"] == {"core"}
    assert "checks" not in MAY_IMPORT["vllm"] and "plugin" not in MAY_IMPORT["vllm"]


def test_result_files_the_library_links_exist():
    """A docstring states its rule and links the dated result that measured it
    (docs/results/<date>-<what>.md): every such link in fixtures/ names a file that exists and is
    listed in docs/results/README.md, so a renamed result never leaves a dead pointer."""
    import re
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    dead = sorted({f"{p.relative_to(ROOT)}: {name}" for p in PKG.rglob("*.py")
                   for name in re.findall(r"docs/results/([\w.-]+\.md)", p.read_text())
                   if not (ROOT / "docs" / "results" / name).is_file() or f"({name})" not in index})
    assert dead == []
