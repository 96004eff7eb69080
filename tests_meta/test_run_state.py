"""The run state is typed (fixtures.runtime.run_state.RunState), a check's result is one type from
its reports to the verdict (fixtures.core.verdicts.CheckRecord) and outcomes are enums
(fixtures.core.outcomes.Outcome, Kind). These pin down what keeps it so: no module reads the run
state by its old string keys, every field says what it holds, and what crosses processes and files
stays plain data (xdist's channel carries builtin types only; report.json is read back)."""
from __future__ import annotations

import ast
import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest

from fixtures.core import outcomes
from fixtures.core.outcomes import CAUSES, Kind, Outcome
from fixtures.core.verdicts import CheckRecord, gate_verdicts
from fixtures.runtime.run_state import RunState

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(RunState)]
# `state["results"]`, `state.get("models")`, `stash[STATE]["impl"]`, `.setdefault("crashed", ...)`
OLD_ACCESS = re.compile(r"""(?:\bstate|stash\[STATE\])\s*(?:\[|\.get\(|\.setdefault\(|\.pop\()\s*["'](""" +
                        "|".join(FIELDS) + r""")["']""")


def _sources():
    here = Path(__file__).resolve()
    for d in ("fixtures", "tests_meta", "tests_c0_inventory", "tests_c5_invariance", "tests_c8_training",
              "tests_c10_delivery", "benchmarks", "examples", "scripts"):
        yield from (p for p in sorted((ROOT / d).rglob("*.py")) if p.resolve() != here)
    yield ROOT / "conftest.py"


def _old_key_reads(paths) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}: {m.group(0)}" for p in paths
            for n, line in enumerate(p.read_text().splitlines(), 1) for m in OLD_ACCESS.finditer(line)]


def test_no_module_reads_the_run_state_by_string_key():
    bad = _old_key_reads(list(_sources()))
    assert not bad, "the run state is a RunState: read its fields (state.results), not string keys:\n  " + \
        "\n  ".join(bad)


def test_the_checker_sees_a_planted_string_key(tmp_path, monkeypatch):
    """The negative control: a planted dict-style read is found, an attribute read is not."""
    planted = tmp_path / "planted.py"
    planted.write_text('def f(config):\n    state = config.stash[STATE]\n    return state["results"], '
                       'config.stash[STATE].get("is_worker"), state.results\n')
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    found = _old_key_reads([planted])
    assert len(found) == 2 and 'state["results"' in found[0] and 'stash[STATE].get("is_worker"' in found[1]


def test_every_run_state_field_says_what_it_holds():
    """Each field carries a comment (what it holds); the section comments above say who writes it."""
    src = (ROOT / "fixtures/runtime/run_state.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "RunState")
    lines = src.splitlines()
    bare = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and "#" not in lines[n.end_lineno - 1]]
    assert not bare, f"RunState fields without a comment: {bare}"


def _record() -> CheckRecord:
    return CheckRecord("t.py::test_x[m]", "C4", "m", outcome="skipped", reason="n/a: no prefix cache",
                       duration=1.23456, kind="n/a", properties={"capability": "CachesPrefixes"},
                       worker="gw1", start=100.0, stop=101.5, cpu_s=0.5, gpu={"own_peak_bytes": 1},
                       memory={}, finished=True)


def test_a_check_record_reads_its_text_as_enums_and_round_trips_json_and_pickle():
    r = _record()
    assert r.outcome is Outcome.SKIPPED and r.kind is Kind.NOT_APPLICABLE
    assert r.prop("capability") == "CachesPrefixes"
    d = json.loads(json.dumps(r.as_dict(run_start=100.0)))
    assert d["outcome"] == "skipped" and d["kind"] == "n/a" and d["span_s"] == [0.0, 1.5]
    assert d["duration_s"] == 1.235 and d["properties"] == {"capability": "CachesPrefixes"}
    back = CheckRecord.from_dict(d)
    assert (back.nodeid, back.outcome, back.kind, back.properties, back.worker) == \
        (r.nodeid, r.outcome, r.kind, r.properties, r.worker)
    assert pickle.loads(pickle.dumps(r)) == r


def test_a_record_and_its_json_form_give_the_same_verdict():
    r = dataclasses.replace(_record(), outcome=Outcome.PASSED, kind=None, properties=())
    v1 = gate_verdicts([r], ["m"], ["C4"])["m"]["C4"]
    v2 = gate_verdicts([CheckRecord.from_dict(json.loads(json.dumps(r.as_dict())))], ["m"], ["C4"])["m"]["C4"]
    assert v1.as_dict() == v2.as_dict()


def test_not_carried_out_outcomes_are_the_causes():
    assert {Outcome.not_carried_out_by(c) for c in CAUSES} == {o for o in Outcome if o.not_carried_out}
    assert Outcome.OUT_OF_MEMORY.cause == "out of memory" and Outcome.PASSED.cause == ""
    assert {o for o in Outcome if o.unfinished} == {Outcome.NOT_RUN, Outcome.INTERRUPTED, Outcome.RUNNING}


@pytest.mark.parametrize("raise_it", [
    lambda: outcomes.not_applicable("x", capability="C"), lambda: outcomes.inconclusive("x", tried="y"),
    lambda: outcomes.blocked("C1", "x"), lambda: outcomes.not_carried_out("x", cause="out of disk")])
def test_what_travels_in_user_properties_is_plain_str(raise_it):
    """xdist's channel (execnet) serialises builtin types only: an enum member in a report's
    user_properties would fail to cross from a worker to the controller."""
    with pytest.raises(outcomes.Skipped) as info:
        raise_it()
    props = outcomes.report_properties(info)
    assert props and all(type(k) is str and type(v) is str for k, v in props), props
