"""Verdict rules: pass / fail / blocked by Ck / missing / not run, per model; a skip's kind (n/a,
inconclusive, blocked) is data (fixtures.core.outcomes), never read from its reason text."""
from __future__ import annotations

from fixtures.core.verdicts import ALL_MODELS, CheckResult, all_passed, gate_verdicts, overall


def r(gate, outcome, model="m", reason="", nodeid=None, kind="", **props):
    return CheckResult(nodeid or f"t::{gate}-{outcome}-{model}-{reason}", gate, model, outcome, reason,
                       kind=kind, properties=tuple(sorted(props.items())))


def v(results, models=("m",), **kw):
    return gate_verdicts(results, models, ("C0", "C1", "C2", "C3"), **kw)


def test_all_pass_then_missing():
    out = v([r("C0", "passed"), r("C1", "passed")])["m"]
    assert [out[g].status for g in ("C0", "C1", "C2", "C3")] == ["pass", "pass", "missing", "missing"]
    assert "no check collected" in out["C2"].reason


def test_missing_is_never_a_pass_and_blocks_later_results():
    out = v([r("C0", "passed"), r("C2", "passed")])["m"]
    assert out["C1"].status == "missing"
    assert out["C2"].status == "blocked" and out["C2"].reason.startswith("blocked by C1")
    assert "1 of 1 checks passed anyway" in out["C2"].reason


def test_fail_blocks_later_gates():
    res = [r("C0", "passed"), r("C1", "failed"), r("C1", "passed"),
           r("C2", "skipped", reason="blocked by C1: C1 failed for m", kind="blocked", blocked_by="C1"),
           r("C3", "skipped", reason="blocked by C1: x", kind="blocked", blocked_by="C1")]
    out = v(res)["m"]
    assert out["C1"].status == "fail" and len(out["C1"].failed) == 1
    assert out["C2"].status == "blocked" and out["C2"].label() == "blocked by C1"
    assert out["C3"].label() == "blocked by C1"


def test_not_run_when_everything_skipped_with_reason():
    out = v([r("C0", "skipped", reason="no CUDA"), r("C0", "skipped", reason="no CUDA", nodeid="b")])["m"]
    assert out["C0"].status == "not run" and "no CUDA (x2)" in out["C0"].reason
    assert out["C1"].status == "missing"


def test_notes_keep_na_and_inconclusive():
    out = v([r("C0", "passed"), r("C0", "skipped", reason="n/a (declared): no prefix cache", kind="n/a"),
             r("C0", "skipped", reason="inconclusive on this hardware: stock GEMM invariant", kind="inconclusive")])["m"]
    assert out["C0"].status == "pass"
    assert len(out["C0"].notes) == 2
    assert [n.kind for n in out["C0"].skip_notes] == ["inconclusive", "n/a"]


def test_the_kind_decides_a_note_not_the_reason_text():
    out = v([r("C0", "passed"), r("C0", "skipped", reason="n/a: typed by hand, no kind"),
             r("C0", "skipped", reason="no prefix cache", kind="n/a", feature="prefix_cache"),
             r("C0", "skipped", reason="no CUDA")])["m"]
    assert out["C0"].status == "pass"
    assert out["C0"].notes == ["no prefix cache [t::C0-skipped-m-no prefix cache]"]


def test_blocked_label_comes_from_the_blocked_by_property():
    """Every check of C1 skipped as blocked (an earlier gate failed on another worker's model):
    the label names the gate from the property, whatever the reason text says."""
    out = v([r("C0", "passed"), r("C1", "skipped", reason="held back", kind="blocked", blocked_by="C0"),
             r("C2", "skipped", reason="blocked by C7: typed by hand")])["m"]
    assert out["C1"].status == "blocked" and out["C1"].label() == "blocked by C0" and out["C1"].reason == "held back"
    assert out["C1"].as_dict()["blocked_by"] == "C0"
    assert out["C2"].status == "blocked" and out["C2"].label() == "blocked by C1"   # C1 is bad: blocked by it


def test_models_are_judged_separately_and_shared_checks_count_for_all():
    res = [r("C0", "passed", model=ALL_MODELS), r("C1", "failed", model="a"), r("C1", "passed", model="b")]
    out = v(res, models=("a", "b"))
    assert out["a"]["C0"].status == out["b"]["C0"].status == "pass"
    assert out["a"]["C1"].status == "fail" and out["b"]["C1"].status == "pass"
    assert overall(out, "C1") == "fail" and overall(out, "C0") == "pass"
    assert all_passed(out, ["C0"]) and not all_passed(out, ["C0", "C1"])


def test_not_requested_gates_say_so():
    out = v([r("C0", "passed")], not_requested=["C2", "C3"])["m"]
    assert out["C3"].status == "missing" and out["C3"].reason == "not requested in this run"


def test_an_earlier_gate_that_did_not_run_leaves_skipped_gates_not_run():
    out = v([r("C0", "skipped", reason="no CUDA"), r("C1", "skipped", reason="no CUDA", nodeid="x"),
             r("C2", "passed")])["m"]
    assert out["C0"].status == "not run" and out["C1"].status == "not run"
    assert out["C2"].status == "blocked" and out["C2"].reason.startswith("blocked by C0: C0 is not run")


def test_a_failed_gate_blocks_even_checks_that_skipped_for_other_reasons():
    out = v([r("C0", "failed"), r("C1", "skipped", reason="no CUDA")])["m"]
    assert out["C1"].status == "blocked" and out["C1"].label() == "blocked by C0"
