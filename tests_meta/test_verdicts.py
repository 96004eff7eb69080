"""Verdict rules: pass / pass with known failures / fail / blocked by Ck (own checks ...) / missing /
not run / incomplete, per model; a chain under --upto, each gate its own verdict under -m; a skip's
kind (n/a, inconclusive, blocked) is data (fixtures.core.outcomes), never read from its reason text."""
from __future__ import annotations

from fixtures.core.gates import DefiningCheck, Gate
from fixtures.core.outcomes import Outcome
from fixtures.core.verdicts import ALL_MODELS, CheckRecord, all_passed, gate_verdicts, overall

# The rules below are the verdict's own; each gate here is defined by one check, `test_defining`
# (tests_meta/test_gate_records.py judges the suite's real records).
RECORDS = {g: Gate(g, g, "", (DefiningCheck(("test_defining",)),)) for g in ("C0", "C1", "C2", "C3")}


def r(gate, outcome, model="m", reason="", nodeid=None, kind="", **props):
    return CheckRecord(nodeid or f"t::test_defining[{gate}-{outcome}-{model}-{reason}]", gate, model, outcome, reason,
                       kind=kind, properties=tuple(sorted(props.items())))


def v(results, models=("m",), **kw):
    return gate_verdicts(results, models, ("C0", "C1", "C2", "C3"), records=RECORDS, **kw)


def test_all_pass_then_missing():
    out = v([r("C0", "passed"), r("C1", "passed")])["m"]
    assert [out[g].status for g in ("C0", "C1", "C2", "C3")] == ["pass", "pass", "missing", "missing"]
    assert "no check collected" in out["C2"].reason


def test_missing_is_never_a_pass_and_blocks_later_results():
    out = v([r("C0", "passed"), r("C2", "passed")])["m"]
    assert out["C1"].status == "missing"
    assert out["C2"].status == "blocked" and out["C2"].reason.startswith("blocked by C1")
    assert out["C2"].label() == "blocked by C1 (own checks 1/1 pass)"
    assert out["C3"].status == "missing"      # no check of its own: missing, not blocked


def test_fail_blocks_later_gates():
    res = [r("C0", "passed"), r("C1", "failed"), r("C1", "passed"),
           r("C2", "skipped", reason="blocked by C1: C1 failed for m", kind="blocked", blocked_by="C1"),
           r("C3", "skipped", reason="blocked by C1: x", kind="blocked", blocked_by="C1")]
    out = v(res)["m"]
    assert out["C1"].status == "fail" and len(out["C1"].failed) == 1
    assert out["C2"].status == "blocked" and out["C2"].label() == "blocked by C1 (own checks skipped)"
    assert out["C3"].label() == "blocked by C1 (own checks skipped)"


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
             r("C0", "skipped", reason="no prefix cache", nodeid="t::test_prefix_cache", kind="n/a",
               feature="prefix_cache"),
             r("C0", "skipped", reason="no CUDA")])["m"]
    assert out["C0"].status == "pass"
    assert out["C0"].notes == ["no prefix cache [t::test_prefix_cache]"]


def test_blocked_label_comes_from_the_blocked_by_property():
    """Every check of C1 skipped as blocked (an earlier gate failed on another worker's model):
    the label names the gate from the property, whatever the reason text says."""
    out = v([r("C0", "passed"), r("C1", "skipped", reason="held back", kind="blocked", blocked_by="C0"),
             r("C2", "skipped", reason="blocked by C7: typed by hand")])["m"]
    assert out["C1"].status == "blocked" and out["C1"].label() == "blocked by C0 (own checks skipped)"
    assert out["C1"].reason == "held back"
    assert out["C1"].as_dict()["blocked_by"] == "C0"
    assert out["C2"].status == "blocked" and out["C2"].label() == "blocked by C1 (own checks not run)"


def test_models_are_judged_separately_and_shared_checks_count_for_all():
    res = [r("C0", "passed", model=ALL_MODELS), r("C1", "failed", model="a"), r("C1", "passed", model="b")]
    out = v(res, models=("a", "b"))
    assert out["a"]["C0"].status == out["b"]["C0"].status == "pass"
    assert out["a"]["C1"].status == "fail" and out["b"]["C1"].status == "pass"
    assert overall(out, "C1") == "fail" and overall(out, "C0") == "pass"
    assert all_passed(out, ["C0"]) and not all_passed(out, ["C0", "C1"])


def test_an_earlier_gate_that_did_not_run_leaves_skipped_gates_not_run():
    out = v([r("C0", "skipped", reason="no CUDA"), r("C1", "skipped", reason="no CUDA", nodeid="x"),
             r("C2", "passed")])["m"]
    assert out["C0"].status == "not run" and out["C1"].status == "not run"
    assert out["C2"].status == "blocked" and out["C2"].reason.startswith("blocked by C0: C0 is not run")
    assert out["C2"].label() == "blocked by C0 (own checks 1/1 pass)"


def test_a_failed_gate_blocks_even_checks_that_skipped_for_other_reasons():
    out = v([r("C0", "failed"), r("C1", "skipped", reason="no CUDA")])["m"]
    assert out["C1"].status == "blocked" and out["C1"].label() == "blocked by C0 (own checks not run)"


def test_a_chain_keeps_running_and_says_how_a_blocked_gate_did_on_its_own():
    """--upto: every gate's checks ran; a gate after a red one reads 'blocked by C1 (own checks 3/3
    pass)', and one that failed itself reads fail - the whole picture in one run."""
    res = [r("C0", "passed"), r("C1", "failed")] + [r("C2", "passed", nodeid=f"t::test_defining[c2-{i}]") for i in range(3)] + \
        [r("C3", "failed", nodeid="t::test_defining[c3-a]"), r("C3", "passed", nodeid="t::test_defining[c3-b]")]
    out = v(res)["m"]
    assert out["C2"].label() == "blocked by C1 (own checks 3/3 pass)" and out["C2"].as_dict()["own_checks"] == "3/3 pass"
    assert out["C3"].status == "fail"
    assert not all_passed(v(res), ["C0", "C1", "C2"])


def test_unchained_gates_get_their_own_verdicts_with_a_note():
    """`pytest -m C2` / `-m "C1 or C3"`: each requested gate its own verdict from its own checks;
    the earlier gates this run did not request are a note, never 'blocked by C0: missing'."""
    alone = gate_verdicts([r("C2", "passed")], ["m"], ("C2",), chained=False, records=RECORDS)["m"]
    assert list(alone) == ["C2"] and alone["C2"].status == "pass"
    assert alone["C2"].notes[0].startswith("earlier gates not run in this run: C0, C1")
    two = gate_verdicts([r("C1", "failed"), r("C3", "passed")], ["m"], ("C1", "C3"), chained=False, records=RECORDS)["m"]
    assert two["C1"].status == "fail" and two["C3"].status == "pass"
    assert "C0, C2" in two["C3"].notes[0]
    first = gate_verdicts([r("C0", "passed")], ["m"], ("C0",), chained=False, records=RECORDS)["m"]
    assert first["C0"].notes == []


def test_known_failures_get_their_own_label_and_block_only_when_strict():
    res = [r("C0", "passed"), r("C1", Outcome.KNOWN_FAILURE, reason="vLLM 0.26 fused_add_rms_norm", nodeid="k"),
           r("C1", "passed"), r("C2", "passed")]
    out = v(res)["m"]
    assert out["C1"].status == "pass with known failures" and out["C1"].label() == "pass with known failures (1)"
    assert out["C1"].known_failures == [("k", "vLLM 0.26 fused_add_rms_norm")]
    assert out["C1"].passed and out["C2"].status == "pass"
    assert not all_passed(v(res), ["C0", "C1"])           # --strict-gates never takes it for a pass
    strict = v(res, known_failures_block=True)["m"]
    assert strict["C2"].label() == "blocked by C1 (own checks 1/1 pass)"
    only_known = v([r("C0", Outcome.KNOWN_FAILURE, reason="x")])["m"]
    assert only_known["C0"].label() == "pass with known failures (1)"
    assert overall({"a": out, "b": v([r("C0", "passed"), r("C1", "passed")])["m"]}, "C1") == "pass with known failures"


def test_every_check_n_a_is_incomplete_never_not_run_or_green():
    """#20: a gate whose every check is n/a for the model verified nothing: incomplete."""
    out = v([r("C0", "passed"), r("C1", "skipped", reason="the reference engine has no decode path", kind="n/a"),
             r("C1", "skipped", reason="no CUDA", nodeid="x")])["m"]
    assert out["C1"].status == "incomplete" and out["C1"].reason.startswith("no check could run for this model")
    assert out["C2"].status == "missing"
