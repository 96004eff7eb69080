"""The plugin end to end, in subprocesses: gate markers, --upto ordering and blocking, verdicts
(also under xdist), the report files, the header, and clear errors for bad input."""
from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]


# Each gate's checks are named as its defining checks (fixtures.core.gates), so a gate whose checks
# pass reads pass; C1's first one fails when asked to ({fail}).
GATE_SUITE = {
    "tests_c0_inventory/test_a.py": """
import pytest
@pytest.mark.C0
def test_no_unmapped_op(): pass
@pytest.mark.C1
def test_same_architecture_class(): assert {fail}
@pytest.mark.C1
def test_every_layer_kind_kept(record_metric): record_metric("answer", 42)
""",
    "tests_c5_invariance/test_b.py": """
import pytest
@pytest.mark.C2
def test_row_independence(): pass
@pytest.mark.C3
def test_c3_skips(): pytest.skip("no CUDA")
""",
}


@pytest.fixture
def suite(write_suite):
    def make(fail: bool = True, extra: dict | None = None):
        files = {k: v.replace("{fail}", "False" if fail else "True") for k, v in GATE_SUITE.items()}
        return write_suite({**files, **(extra or {})})
    return make


def run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider", *args)


def test_upto_blocks_later_gates_and_reports(suite):
    pt = suite(fail=True)
    res = run(pt, "--upto", "C3", "--report=rep")
    res.assert_outcomes(passed=3, failed=1, skipped=1)     # C2's check still runs after C1 failed
    out = res.stdout.str()
    assert "gate verdicts" in out and "blocked by C1 (own checks 1/1 pass)" in out
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    v = {g: doc["gates"][g]["models"]["llama"] for g in doc["gates"]}
    assert list(v) == ["C0", "C1", "C2", "C3"], "the table lists the requested gates only"
    assert v["C0"]["status"] == "pass" and v["C1"]["status"] == "fail"
    assert v["C2"]["status"] == "blocked" and v["C2"]["label"] == "blocked by C1 (own checks 1/1 pass)"
    assert v["C3"]["status"] == "blocked" and v["C3"]["label"] == "blocked by C1 (own checks not run)"
    assert doc["metrics"] == [{"gate": "C1", "model": "*", "nodeid": "tests_c0_inventory/test_a.py::test_every_layer_kind_kept",
                               "name": "answer", "value": 42}]
    assert (pt.path / "rep" / "junit.xml").is_file()
    md = (pt.path / "rep" / "report.md").read_text()
    assert "| C1 | [Proxy model](docs/porting-guide.md#c1-proxy-model) | [ ] fail (1/2) |" in md


def test_maxfail_skips_a_failed_gates_later_checks_as_blocked(suite):
    """Told to stop early (--maxfail), the chain saves the time: later gates' checks skip as blocked."""
    res = run(suite(fail=True), "--upto", "C3", "--maxfail=5")
    res.assert_outcomes(passed=2, failed=1, skipped=2)
    assert "blocked by C1 (own checks skipped)" in res.stdout.str()


def test_one_gate_by_marker_gets_its_own_verdict(suite):
    """`pytest -m C2` prints C2 PASS - not "blocked by C0: C0 is missing" - and lists only C2."""
    pt = suite(fail=True)
    res = run(pt, "-m", "C2", "--report=rep", "--strict-gates")
    assert res.ret == 0, res.stdout.str()
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    assert list(doc["gates"]) == ["C2"]
    c2 = doc["gates"]["C2"]["models"]["llama"]
    assert c2["status"] == "pass" and c2["notes"][0].startswith("earlier gates not run in this run: C0, C1")
    table = res.stdout.str().split("gate verdicts", 1)[1]
    assert "C2    Kernel invariance  PASS" in table and "C1 " not in table.split("\n\n")[0]
    both = json.loads((run(pt, "-m", "C1 or C2", "--report=rep2"), pt.path / "rep2" / "report.json")[1].read_text())
    assert {g: both["gates"][g]["overall"] for g in both["gates"]} == {"C1": "fail", "C2": "pass"}


def test_all_green_gives_pass_and_not_run(suite):
    pt = suite(fail=False)
    res = run(pt, "--report=rep")
    res.assert_outcomes(passed=4, skipped=1)
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    status = {g: doc["gates"][g]["overall"] for g in doc["gates"]}
    assert status["C0"] == status["C1"] == status["C2"] == "pass"
    assert status["C3"] == "not run" and "no CUDA" in doc["gates"]["C3"]["models"]["llama"]["reason"]
    assert all(status[g] == "missing" for g in ("C4", "C5", "C10"))


def test_strict_gates_turns_missing_into_a_red_exit(suite):
    pt = suite(fail=False)
    assert run(pt, "--upto", "C2").ret == 0
    assert run(pt, "--upto", "C2", "--strict-gates").ret == 0
    assert run(pt, "--upto", "C4", "--strict-gates").ret == 1   # C3 not run, C4 missing


def test_verdicts_computed_once_by_the_xdist_controller(suite):
    pytest.importorskip("xdist")
    pt = suite(fail=True)
    res = run(pt, "-n", "2", "--upto", "C3", "--report=rep")
    assert res.ret == 1
    out = res.stdout.str()
    assert out.count("gate verdicts") == 1
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    v = {g: doc["gates"][g]["models"]["llama"]["status"] for g in ("C0", "C1", "C2", "C3")}
    assert v == {"C0": "pass", "C1": "fail", "C2": "blocked", "C3": "blocked"}
    assert doc["metrics"] and doc["metrics"][0]["value"] == 42


ORDER_SUITE = {
    "tests_c0_inventory/test_order.py": """
import os, time
import pytest
def _log(name):
    with open("order.txt", "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {name}\\n")
@pytest.mark.C0
def test_first_gate(): _log("c0")
@pytest.mark.C1
def test_second_gate(): _log("c1")
@pytest.mark.C2
def test_third_gate(): _log("c2")
@pytest.mark.C10
@pytest.mark.slow
def test_rollout_scale(): time.sleep(0.5); _log("c10-slow")
@pytest.mark.C10
@pytest.mark.slow(seconds=200)
def test_throughput(): time.sleep(0.5); _log("c10-slow2")
@pytest.mark.C10
def test_quick(): _log("c10")
""",
}


def _order(pt) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in (pt.path / "order.txt").read_text().splitlines()]


def test_one_process_keeps_gate_order(write_suite):
    pt = write_suite(ORDER_SUITE)
    assert run(pt, "--upto", "C10").ret == 0
    assert [n for _, n in _order(pt)] == ["c0", "c1", "c2", "c10-slow", "c10-slow2", "c10"]


@pytest.mark.parametrize("workers", [1, 2])
def test_under_xdist_slow_checks_start_first_one_per_worker(write_suite, workers):
    """xdist hands out checks in collection order, two at a time to start with (the plugin sets
    --maxschedchunk 1): a long check of the last gate would otherwise run alone at the end, and
    with the default chunking every slow check landed on one worker. Slow checks go longest first."""
    pytest.importorskip("xdist")
    pt = write_suite(ORDER_SUITE)
    assert run(pt, "-n", str(workers), "--upto", "C10").ret == 0
    order = _order(pt)
    assert sorted(n for _, n in order) == sorted(["c0", "c1", "c2", "c10-slow", "c10-slow2", "c10"])
    by_worker = {}
    for w, n in order:
        by_worker.setdefault(w, []).append(n)
    if workers == 1:
        # the slow checks longest first by their mark's seconds (200 vs the default 60)
        assert [n for _, n in order][:3] == ["c10-slow2", "c0", "c10-slow"], order
    else:
        assert {ws[0] for ws in by_worker.values()} == {"c10-slow", "c10-slow2"}, by_worker    # one each, first


def test_a_check_without_gate_marker_is_a_collection_error(suite):
    pt = suite(extra={"tests_c8_training/test_c.py": "def test_unmarked(): pass\n"})
    res = run(pt)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert "exactly one gate marker" in res.stderr.str() and "test_unmarked: no gate marker" in res.stderr.str()


def test_header_echoes_the_implementation(suite):
    res = run(suite(fail=False), "--co")
    out = res.stdout.str()
    assert "conformance impl: impl=reference" in out
    assert "conformance models: llama; proxy: tiny" in out
    assert "conformance device: cpu" in out


def test_a_family_is_named_by_its_directory(suite):
    """--model=zamba2 runs the shipped family config (fixtures/models/families/zamba2), as
    --model=all-families runs all of them; an unknown name's usage error lists the names."""
    from fixtures.models.proxies import FAMILIES_DIR
    out = run(suite(fail=False), "--co", "--model=zamba2").stdout.str()
    assert f"conformance models: llama, {FAMILIES_DIR / 'zamba2'}; proxy: tiny" in out, out


@pytest.mark.parametrize("args, message", [
    (["--model=/no/such/model/dir"], "no such directory"),
    (["--model=unknown_arch"], "no such directory (built-in recipes: "),
    (["--model=unknown_arch"], "; families, by name: bamba, "),
    (["--impl", "no_such_module:make"], "cannot import module 'no_such_module'"),
    (["--impl", "fixtures.core.gates:GATES"], "has no callable 'GATES'"),
    (["--impl", "noformat"], "expected a built-in name"),
    (["--upto", "C99"], "unknown gate 'C99'"),
])
def test_bad_input_is_a_clear_usage_error(suite, args, message):
    pt = suite(fail=False)
    res = pt.runpytest_inprocess("-p", "fixtures.plugin.session", "-p", "no:cacheprovider", *args)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    err = res.stderr.str()
    assert message in err, err
    assert "Traceback" not in err


def test_corrupt_and_foreign_model_dirs(suite, tmp_path):
    pt = suite(fail=False)
    bad = tmp_path / "corrupt"; bad.mkdir(); (bad / "config.json").write_text("{not json")
    foreign = tmp_path / "foreign"; foreign.mkdir(); (foreign / "config.json").write_text('{"model_type": "bert"}')
    empty = tmp_path / "empty"; empty.mkdir()
    for d, message in ((bad, "not valid JSON"), (foreign, "no proxy recipe"), (empty, "has no config.json")):
        res = pt.runpytest_inprocess("-p", "fixtures.plugin.session", f"--model={d}")
        assert res.ret == pytest.ExitCode.USAGE_ERROR and message in res.stderr.str(), res.stderr.str()


def test_known_failures_file_is_strict_and_reports_stale_ids(suite):
    pt = suite(fail=True)
    (pt.path / "known.txt").write_text(
        "tests_c0_inventory/test_a.py::test_same_architecture_class  # tracked upstream: fused norm switches blocks at 256\n"
        "tests_c0_inventory/test_a.py::test_gone  # renamed long ago\n")
    res = run(pt, "--xfails", "known.txt", "--report=rep")
    res.assert_outcomes(passed=3, xfailed=1, skipped=1)
    assert "--xfails entry matches no collected test: tests_c0_inventory/test_a.py::test_gone" in res.stdout.str()
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    assert doc["run"]["stale_xfails"] == ["tests_c0_inventory/test_a.py::test_gone"]
    c1 = doc["gates"]["C1"]["models"]["llama"]
    assert c1["status"] == "pass with known failures" and c1["label"] == "pass with known failures (1)"
    assert c1["known_failures"] == [{"nodeid": "tests_c0_inventory/test_a.py::test_same_architecture_class",
                                     "reason": "tracked upstream: fused norm switches blocks at 256"}]
    assert doc["gates"]["C2"]["models"]["llama"]["status"] == "pass", "a known failure does not block"
    md = (pt.path / "rep" / "report.md").read_text()
    assert "PASS WITH KNOWN FAILURES (1)" in res.stdout.str()
    assert "### Known failures (--xfails, 1)" in md and "fused norm switches blocks at 256" in md
    strict = run(pt, "--xfails", "known.txt", "--upto", "C2", "--strict-gates", "--report=rep3")
    assert strict.ret == 1
    doc = json.loads((pt.path / "rep3" / "report.json").read_text())
    assert doc["gates"]["C2"]["models"]["llama"]["label"] == "blocked by C1 (own checks 1/1 pass)"
    # strict: a known failure that passes is a failure
    pt2 = suite(fail=False)
    res = run(pt2, "--xfails", "known.txt")
    res.assert_outcomes(passed=3, failed=1, skipped=1)


def test_known_failure_without_reason_is_refused(suite):
    pt = suite(fail=True)
    (pt.path / "known.txt").write_text("tests_c0_inventory/test_a.py::test_same_architecture_class\n")
    res = run(pt, "--xfails", "known.txt")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and "needs a reason" in res.stderr.str()


def test_a_killed_run_still_leaves_a_report_that_says_so(suite):
    import signal
    import subprocess
    import sys
    import time
    pt = suite(fail=False, extra={"tests_c8_training/test_slow.py": """
import time, pytest
@pytest.mark.C6
def test_slow():
    time.sleep(60)
"""})
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "fixtures.plugin.session", "--model", "llama",
                             "-p", "no:cacheprovider", "--report=rep"], cwd=pt.path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    report = pt.path / "rep" / "report.json"
    deadline = time.time() + 300    # only a cap: a starved 2-core machine can take minutes to start pytest
    while time.time() < deadline and not report.exists():
        time.sleep(0.2)
    assert report.exists(), "no report was written while the run was going on"
    doc = json.loads(report.read_text())
    assert doc["run"]["status"] == "running" and "did not finish" in doc["run"]["interrupted"]
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    doc = json.loads(report.read_text())
    assert doc["run"]["status"] == "interrupted"    # not "finished": see tests_meta/test_report_survives.py
    assert "interrupted" in doc["run"]["interrupted"]
    assert "The run did not finish" in (pt.path / "rep" / "report.md").read_text()


def test_a_bitwise_failure_leaves_its_difference_in_the_report(suite):
    pt = suite(fail=False, extra={"tests_c8_training/test_d.py": """
import pytest, torch
from fixtures.core.comparison import assert_bitwise
@pytest.mark.C6
def test_diff():
    a = torch.tensor([[-1.0, -2.0, -3.0]])
    b = a.clone(); b[0, 1] = -2.5
    assert_bitwise(a, b, what="logprobs", lhs_name="alone", rhs_name="batch")
"""})
    run(pt, "--report=rep")
    files = list((pt.path / "rep" / "artifacts" / "differences").glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["first"] == [0, 1] and doc["count"] == 1 and doc["first_sequence_absdiff"] == [0.0, 0.5, 0.0]


def test_a_failing_example_is_reported_as_drawn_not_shrunk():
    """The suite's profiles stop at the first failing example and report it (its diagnosis runs
    once): shrinking a bitwise mismatch re-ran a tiny Zamba2's engine for up to hypothesis' 300 s
    limit per check. Control: the 'shrink' profile still shrinks, to the boundary value."""
    from hypothesis import given, settings, strategies as st

    def calls(profile: str) -> list[int]:
        seen = []

        @settings(settings.get_profile(profile), database=None, derandomize=True, max_examples=200)
        @given(st.integers(0, 10**6))
        def check(n):
            seen.append(n)
            assert n < 1000
        with pytest.raises(AssertionError):
            check()
        return seen
    for profile in ("ci", "dev", "nightly"):
        seen = calls(profile)
        first = next(i for i, n in enumerate(seen) if n >= 1000)
        assert set(seen[first:]) == {seen[first]}, f"{profile} shrank: {seen[first:first + 5]} ..."
    shrunk = calls("shrink")
    assert shrunk[-1] == 1000 and len(shrunk) > 3, shrunk[-5:]


def test_a_failed_checks_reason_says_what_differed(suite):
    """The report's reason for a failed check carries the failure's first two lines (what was
    compared, the first difference) with the exception's class, not only "call failed"; an
    exception without a message keeps its class alone, a long one is cut at 400 characters."""
    long_line = "x" * 600
    pt = suite(fail=False, extra={"tests_c8_training/test_msg.py": f"""
import pytest
class BitwiseMismatch(AssertionError):
    pass
@pytest.mark.C6
def test_mismatch():
    raise BitwiseMismatch("decode != prefill (bitwise)\\n\\n  first difference at token 3: -1.5 (0xbfc00000) vs -1.25 (0xbfa00000)\\n  more")
@pytest.mark.C6
def test_bare():
    raise RuntimeError
@pytest.mark.C6
def test_long():
    raise ValueError("{long_line}")
"""})
    run(pt, "--report=rep")
    checks = {c["nodeid"].split("::")[-1]: c for c in json.loads((pt.path / "rep" / "report.json").read_text())["checks"]}
    assert checks["test_mismatch"]["reason"] == ("call failed: BitwiseMismatch: decode != prefill (bitwise); first "
                                                 "difference at token 3: -1.5 (0xbfc00000) vs -1.25 (0xbfa00000)")
    assert checks["test_bare"]["reason"] == "call failed: RuntimeError"
    assert len(checks["test_long"]["reason"]) == len("call failed: ") + 400 and checks["test_long"]["reason"].endswith("...")
