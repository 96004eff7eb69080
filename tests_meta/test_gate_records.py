"""The gate records (fixtures/core/gates.py) are the single source of each gate's name, criterion,
defining checks and porting-guide section, and a gate passes only on its defining comparison:
for every gate, its defining check n/a with a side check passing and a control fired reads
incomplete; a check not carried out reads incomplete, never fail and never pass (#44)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.core.gates import GATE_RECORDS, TABLE_BEGIN, TABLE_END, check_function, gates_table, with_gates_table
from fixtures.core.outcomes import CONTROL_FIRED, NOT_APPLICABLE
from fixtures.core.outcomes import Outcome
from fixtures.core.verdicts import CheckRecord, gate_verdicts

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]
GATE_DIRS = ("tests_c0_inventory", "tests_c5_invariance", "tests_c8_training", "tests_c10_delivery")


def _suite_checks() -> dict[str, set[str]]:
    """gate -> the check functions of the suite's tree that carry its marker (read from the source:
    the module's pytestmark)."""
    out: dict[str, set[str]] = {}
    for d in GATE_DIRS:
        for path in sorted((ROOT / d).glob("test_*.py")):
            tree = ast.parse(path.read_text())
            gates = set()
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                    gates |= {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute) and n.attr[:1] == "C"
                              and n.attr[1:].isdigit()}
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
            for g in gates:
                out.setdefault(g, set()).update(names)
    return out


@pytest.mark.parametrize("gate", GATE_RECORDS, ids=lambda g: g.id)
def test_every_defining_check_is_a_check_of_its_gate(gate):
    checks = _suite_checks().get(gate.id, set())
    for d in gate.defining:
        assert set(d.tests) & checks, f"{gate.id}: defining check {d.name} is no check of the gate ({sorted(checks)})"
        assert not any("control" in t or "planted" in t for t in d.tests), \
            f"{gate.id}: a negative control cannot be a gate's evidence ({d.name})"


def test_tables_in_readme_and_gates_doc_are_the_records():
    for name in ("README.md", "docs/gates.md"):
        text = (ROOT / name).read_text()
        assert TABLE_BEGIN in text and TABLE_END in text, f"{name}: no generated gates table"
        assert with_gates_table(text) == text, f"{name}'s gates table is stale: run `python -m fixtures.core.gates --write`"
    assert gates_table().count("\n") == len(GATE_RECORDS) + 1


def test_porting_guide_has_each_gates_anchor():
    guide = (ROOT / "docs/porting-guide.md").read_text()
    for g in GATE_RECORDS:
        assert f"### {g.id} {g.name}\n" in guide, f"docs/porting-guide.md has no heading '### {g.id} {g.name}'"
    from fixtures.core.environment import porting_guide_section
    assert porting_guide_section("C4") == "docs/porting-guide.md#c4-prefilldecode-invariance"


def test_markers_come_from_the_records_only():
    """pyproject lists no gate marker of its own (the plugin registers each record's)."""
    import tomllib
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert not [m for m in markers if m.split(":")[0] in {g.id for g in GATE_RECORDS}]
    assert all(g.marker.startswith(f"{g.id}: gate {g.id} - {g.name}: passes when ") for g in GATE_RECORDS)


def test_check_function_reads_the_node_id():
    assert check_function("tests_c5/t.py::test_needle[greedy-llama-3]") == "test_needle"
    assert check_function("t.py::test_plain") == "test_plain"


# ---------------------------------------------------------------------------------------------
# the verdict rule over the real records
# ---------------------------------------------------------------------------------------------
def _results(gate, defining_outcome, *, kind=NOT_APPLICABLE, reason="n/a: the trainer covers no layer of it"):
    res = []
    for d in gate.defining:
        res.append(CheckRecord(f"t.py::{d.tests[0]}[m]", gate.id, "m", defining_outcome,
                               reason if defining_outcome != "passed" else "",
                               kind=kind if defining_outcome == "skipped" else ""))
    res.append(CheckRecord("t.py::test_a_side_check[m]", gate.id, "m", "passed"))
    res.append(CheckRecord("t.py::test_control_stock_is_seen[m]", gate.id, "m", "passed", kind=CONTROL_FIRED))
    return res


@pytest.mark.parametrize("gate", GATE_RECORDS, ids=lambda g: g.id)
def test_defining_check_n_a_with_side_checks_passing_is_incomplete(gate):
    v = gate_verdicts(_results(gate, "skipped"), ["m"], [gate.id], chained=False)["m"][gate.id]
    assert v.status == "incomplete", (gate.id, v.status, v.reason)
    first = gate.defining[0].name
    assert v.label().startswith(f"incomplete ({first}: n/a: the trainer covers no layer of it"), v.label()
    assert "not the gate's evidence" in v.reason and not v.passed


@pytest.mark.parametrize("gate", GATE_RECORDS, ids=lambda g: g.id)
def test_defining_check_passing_passes(gate):
    v = gate_verdicts(_results(gate, "passed"), ["m"], [gate.id], chained=False)["m"][gate.id]
    assert v.status == "pass", (gate.id, v.reason)


@pytest.mark.parametrize("gate", GATE_RECORDS, ids=lambda g: g.id)
def test_one_defining_check_missing_is_incomplete(gate):
    """A gate with several defining checks needs each; one not collected (e.g. deselected by -k)
    is enough to leave it incomplete."""
    res = [r for r in _results(gate, "passed") if check_function(r.nodeid) != gate.defining[-1].tests[0]]
    v = gate_verdicts(res, ["m"], [gate.id], chained=False)["m"][gate.id]
    assert v.status == "incomplete" and v.missing_evidence == [f"{gate.defining[-1].name}: not collected in this run"]


@pytest.mark.parametrize("outcome", [Outcome.OUT_OF_MEMORY, Outcome.OUT_OF_DISK, Outcome.PRECONDITION])
def test_not_carried_out_is_incomplete_never_fail_never_pass(outcome):
    gate = GATE_RECORDS[7]
    res = _results(gate, "passed") + [CheckRecord("t.py::test_at_scale[m]", gate.id, "m", outcome, "the KV cache kept nothing")]
    per = gate_verdicts(res, ["m"], ["C6", gate.id])["m"]
    v = per[gate.id]
    assert v.status == "incomplete" and v.errors == {"t.py::test_at_scale[m]": outcome}
    assert v.reason.startswith("1 of 4 checks not carried out: test_at_scale: " + outcome.split(": ")[1])
    assert not v.failed
    assert gate_verdicts(res + [CheckRecord("t.py::test_x[m]", gate.id, "m", "failed", "BitwiseMismatch")],
                         ["m"], [gate.id])["m"][gate.id].status == "fail"     # a real failure still reads fail


def test_not_carried_out_raised_by_a_check_is_its_own_outcome(write_suite):
    """outcomes.not_carried_out in a check: the report's outcome is "not carried out: precondition"
    and the gate reads incomplete; an out-of-disk error likewise (never a failure of the stack)."""
    pt = write_suite({"tests_c0_inventory/test_a.py":
                      "import errno, pytest\n"
                      "from fixtures.core.outcomes import not_carried_out\n"
                      "pytestmark = pytest.mark.C0\n"
                      "def test_no_unmapped_op(): pass\n"
                      "def test_cache(): not_carried_out('the prefix cache held 0 of 24 prompts at the push')\n"
                      "def test_disk(): raise OSError(errno.ENOSPC, 'No space left on device')\n"})
    pt.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                           "--report=rep", "-m", "C0")
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    checks = {c["nodeid"].rpartition("::")[2]: c for c in doc["checks"]}
    assert checks["test_cache"]["outcome"] == "not carried out: precondition", checks["test_cache"]
    assert checks["test_cache"]["reason"] == "not carried out (precondition): the prefix cache held 0 of 24 prompts at the push"
    assert checks["test_disk"]["outcome"] == "not carried out: out of disk", checks["test_disk"]
    c0 = doc["gates"]["C0"]["models"]["llama"]
    assert c0["status"] == "incomplete" and not c0["failed"], c0
    assert "2 of 3 checks not carried out" in c0["reason"]


def test_a_stack_whose_trainer_covers_nothing_reads_c6_to_c9_incomplete(tmp_path):
    """The reference stack with no trainer for the model (fixtures.faults.partial_stacks): C6-C9's
    side checks and controls pass (stock-trainer controls, same-TP, per-op kernel cases), yet not
    one trainer logprob was computed - each of C6-C9 reads incomplete, naming its defining check."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    report = tmp_path / "report"
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "--impl", "fixtures.faults.partial_stacks:trainer_without_logprobs",
           "--model=llama", "-m", "C6 or C7 or C8 or C9", f"--report={report}", "--hypothesis-profile", "ci",
           "-q", "-p", "no:warnings"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert (report / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    doc = json.loads((report / "report.json").read_text())
    for gate in ("C6", "C7", "C8", "C9"):
        v = doc["gates"][gate]["models"]["llama"]
        assert v["status"] == "incomplete" and not v["failed"], (gate, v["status"], v["reason"][:300])
        assert "this trainer covers no layer of this architecture" in v["label"], (gate, v["label"])
    assert any(c["outcome"] == "passed" for c in doc["checks"] if c["gate"] in ("C6", "C7", "C8")), \
        "the side checks that used to carry these gates did not run: the control of this test is gone"
