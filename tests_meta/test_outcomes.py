"""Outcomes as data (fixtures.core.outcomes): n/a, inconclusive, blocked and fired controls carry
their kind as report properties, the verdicts read the kind (never the reason text), the notes are
grouped by reason, and what hypothesis prints of a falsifying example stays short."""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest

from fixtures.core import outcomes as O
from fixtures.core.comparison import BitwiseMismatch, assert_bitwise
from fixtures.core.verdicts import ALL_MODELS, CheckRecord, gate_verdicts
from fixtures.plugin import report as R

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def _raised(fn, *args, **kw) -> BaseException:
    with pytest.raises(pytest.skip.Exception) as e:
        fn(*args, **kw)
    return e.value


# ---------------------------------------------------------------------------------------------
# the API
# ---------------------------------------------------------------------------------------------
def test_not_applicable_is_pytest_skip_with_its_kind():
    class RecordsModuleOutputs:
        pass
    e = _raised(O.not_applicable, "no prefix cache", feature="prefix_cache")
    assert str(e) == "n/a (declared): no prefix cache" and isinstance(e, pytest.skip.Exception)
    assert e.properties == (("outcome", "n/a"), ("feature", "prefix_cache"))
    e = _raised(O.not_applicable, "the trainer records no module outputs", capability=RecordsModuleOutputs)
    assert str(e) == "n/a: the trainer records no module outputs"
    assert dict(e.properties) == {"outcome": "n/a", "capability": "RecordsModuleOutputs"}
    assert type(e).__name__ == "Skipped" and type(e).__module__ == "builtins"   # prints as pytest's own


def test_not_available_keeps_the_implementations_message():
    e = _raised(O.not_available, NotImplementedError("n/a: no engine on CPU"), "no engine")
    assert str(e) == "n/a: no engine on CPU" and dict(e.properties)["outcome"] == "n/a"
    assert str(_raised(O.not_available, NotImplementedError("later"), "no engine")) == "n/a (no engine): later"


def test_inconclusive_and_blocked():
    e = _raised(O.inconclusive, "stock decode equalled stock prefill", tried="3 prompts")
    assert str(e) == "inconclusive on this hardware: stock decode equalled stock prefill"
    assert e.properties == (("outcome", "inconclusive"), ("tried", "3 prompts"))
    e = _raised(O.inconclusive, "TP=2 matched", tried=[1, 2], on_this_hardware=False)
    assert str(e) == "inconclusive: TP=2 matched" and dict(e.properties)["tried"] == "1, 2"
    e = _raised(O.blocked, "C1", "C1 failed for llama")
    assert str(e) == "blocked by C1: C1 failed for llama"
    assert e.properties == (("outcome", "blocked"), ("blocked_by", "C1"))


def test_must_fire_records_a_fired_control_and_runs_on():
    import torch
    O.report_properties(None)                       # nothing left over from another test
    with O.must_fire("never printed", tried="x") as control:
        assert_bitwise(torch.zeros(2), torch.ones(2), what="control")
    assert isinstance(control.exc, BitwiseMismatch)
    props = dict(O.report_properties(None))
    assert props["outcome"] == "control fired" and props["fired"].startswith("BitwiseMismatch")
    assert O.report_properties(None) == []          # taken once, into that test's report


def test_must_fire_that_does_not_fire_is_inconclusive():
    e = _raised(lambda: O.must_fire("stock kernels gave the same bits", tried="batch 1 and 7").__exit__(None, None, None))
    assert str(e) == "inconclusive on this hardware: stock kernels gave the same bits"
    with pytest.raises(pytest.skip.Exception, match="inconclusive on this hardware: same"):
        with O.must_fire("same", tried="t"):
            pass
    with pytest.raises(AssertionError):              # not a control's exception: a real failure
        with O.must_fire("same", tried="t"):
            raise AssertionError("bad")
    with O.must_fire("same", tried="t", catch=(BitwiseMismatch, AssertionError)) as control:
        raise AssertionError("metrics not 0")
    assert str(control.exc) == "metrics not 0"
    O.report_properties(None)


def test_the_reason_text_is_only_a_fallback_for_third_party_skips():
    assert O.kind_from_reason("n/a: declared by hand") == "n/a"
    assert O.kind_from_reason("inconclusive on this hardware: x") == "inconclusive"
    assert O.kind_from_reason("blocked by C1: typed by hand") == ""     # only the plugin blocks
    assert O.kind_from_reason("no CUDA") == ""


# ---------------------------------------------------------------------------------------------
# end to end: the properties reach the verdicts, also through the xdist controller
# ---------------------------------------------------------------------------------------------
SUITE = {
    "tests_c0_inventory/test_a.py": """
import pytest
from fixtures.core.outcomes import must_fire, not_applicable

@pytest.fixture
def no_cache():
    not_applicable("no prefix cache", feature="prefix_cache")

@pytest.mark.C0
def test_no_unmapped_op(): pass        # C0's defining check (fixtures.core.gates): the gate's evidence
@pytest.mark.C0
def test_uses_cache(no_cache): pass
@pytest.mark.C0
def test_control_fires():
    with must_fire("never", tried="t"):
        _mismatch()
@pytest.mark.C0
def test_control_silent():
    with must_fire("stock kernels gave the same bits", tried="rows 1, 2"):
        pass
@pytest.mark.C0
def test_third_party_na(): pytest.skip("n/a: a third party's own skip")
@pytest.mark.C0
def test_plain_skip(): pytest.skip("no CUDA")
@pytest.mark.C1
def test_c1_fails(): assert {fail}
@pytest.mark.C2
def test_c2(): pass

def _mismatch():
    import torch
    from fixtures.core.comparison import assert_bitwise
    assert_bitwise(torch.zeros(1), torch.ones(1), what="stock")
""",
}


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def make(fail: bool):
        for path, text in SUITE.items():
            p = pytester.path / path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text.replace("{fail}", "False" if fail else "True"))
        return pytester
    return make


def _run(pt, *args):
    return pt.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                  "--report=rep", *args)


@pytest.mark.parametrize("xdist", [False, True], ids=["single", "xdist"])
def test_outcomes_reach_the_verdicts(suite, xdist):
    if xdist:
        pytest.importorskip("xdist")
    pt = suite(fail=True)
    # xdist: one file on one worker (--dist loadfile), so C2 runs after C1 failed; the properties
    # still travel from the worker to the controller (--maxfail: a failed gate's later checks skip as blocked)
    res = _run(pt, "--upto", "C2", "--maxfail=10", "-rs", *(["-n", "2", "--dist", "loadfile"] if xdist else []))
    res.assert_outcomes(passed=2, failed=1, skipped=5)
    out = res.stdout.str()
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    checks = {c["nodeid"].rpartition("::")[2]: c for c in doc["checks"]}
    assert checks["test_uses_cache"]["kind"] == "n/a" and checks["test_uses_cache"]["properties"] == {"feature": "prefix_cache"}
    assert checks["test_uses_cache"]["reason"] == "n/a (declared): no prefix cache"     # the text as before
    assert checks["test_control_fires"]["outcome"] == "passed" and checks["test_control_fires"]["kind"] == "control fired"
    assert checks["test_control_silent"]["kind"] == "inconclusive"
    assert checks["test_control_silent"]["properties"] == {"tried": "rows 1, 2"}
    assert checks["test_third_party_na"]["kind"] == "n/a"          # the fallback on the reason text
    assert "kind" not in checks["test_plain_skip"] and "kind" not in checks["test_no_unmapped_op"]
    assert checks["test_c2"]["kind"] == "blocked" and checks["test_c2"]["properties"] == {"blocked_by": "C1"}
    c0 = doc["gates"]["C0"]["models"]["llama"]
    assert c0["status"] == "pass" and len(c0["notes"]) == 3
    c2 = doc["gates"]["C2"]["models"]["llama"]
    assert c2["status"] == "blocked" and c2["label"] == "blocked by C1 (own checks skipped)" and c2["blocked_by"] == "C1"
    assert "C0 n/a (declared) (1 check; llama): no prefix cache - test_uses_cache" in out
    assert "C0 inconclusive on this hardware (1 check; llama): stock kernels gave the same bits - test_control_silent" in out
    assert re.search(r"SKIPPED \[1\] tests_c0_inventory/test_a.py:\d+: n/a \(declared\): no prefix cache", out)  # -rs
    md = (pt.path / "rep" / "report.md").read_text()
    assert "- C0 n/a (1 check; llama): a third party's own skip - test_third_party_na" in md


# ---------------------------------------------------------------------------------------------
# notes grouped by reason
# ---------------------------------------------------------------------------------------------
GATES = ("C0", "C2", "C7")


def _verdicts(results, models=("llama", "qwen3", "mamba2")):
    from fixtures.core.gates import DefiningCheck, Gate
    records = {g: Gate(g, g, "", (DefiningCheck(("test_ok",)),)) for g in GATES}
    return gate_verdicts(results, models, GATES, records=records)


def _skip(gate, nodeid, model, reason, kind="n/a"):
    return CheckRecord(nodeid, gate, model, "skipped", reason, kind=kind)


def test_notes_are_grouped_by_reason_with_count_models_and_tests():
    models = ("llama", "qwen3", "mamba2")
    res = [CheckRecord(f"t.py::test_ok[{m}]", g, m, "passed") for m in models for g in ("C0", "C2", "C7")]
    res += [_skip("C7", f"t.py::test_control_planted_ulp_is_named[{m}]", m, "n/a: the trainer records no module outputs")
            for m in models]
    res += [_skip("C7", f"t.py::test_every_module_output[{m}]", m, "n/a: the trainer records no module outputs")
            for m in models[:2]]
    res += [_skip("C0", f"t.py::test_modes[{m}-{f}-{f}]", m, f"n/a (declared): the engine does not declare {f}")
            for m in models for f in ("cuda_graphs", "compilation")]
    res += [_skip("C2", f"t.py::test_stock[{k}]", ALL_MODELS, f"inconclusive on this hardware: stock {k} showed no "
                  "difference at rows 1, 2", kind="inconclusive") for k in ("sum", "max", "mean")]
    v = _verdicts(res)
    lines = R.reasons(v, GATES)
    assert lines == [
        "C0 n/a (declared) (3 checks; all models): the engine does not declare compilation - test_modes[compilation-compilation]",
        "C0 n/a (declared) (3 checks; all models): the engine does not declare cuda_graphs - test_modes[cuda_graphs-cuda_graphs]",
        "C2 inconclusive on this hardware (1 check; all models): stock max showed no difference at rows 1, 2 - test_stock[max]",
        "C2 inconclusive on this hardware (1 check; all models): stock mean showed no difference at rows 1, 2 - test_stock[mean]",
        "C2 inconclusive on this hardware (1 check; all models): stock sum showed no difference at rows 1, 2 - test_stock[sum]",
        "C7 n/a (5 checks; all models): the trainer records no module outputs - test_control_planted_ulp_is_named, "
        "test_every_module_output",
    ]
    assert R.reasons(v, GATES, merge=True, max_tests=1) == [
        "C0 n/a (declared) (6 checks; all models): the engine does not declare {compilation, cuda_graphs} - test_modes (2 cases)",
        "C2 inconclusive on this hardware (3 checks; all models): stock {max, mean, sum} showed no difference at rows 1, 2 "
        "- test_stock (3 cases)",
        "C7 n/a (5 checks; all models): the trainer records no module outputs - test_control_planted_ulp_is_named and 1 more",
    ]


def test_groups_name_the_models_they_cover_and_keep_crash_notes_apart():
    res = [CheckRecord(f"t.py::test_ok[{m}]", "C0", m, "passed") for m in ("llama", "qwen3", "mamba2")]
    res += [_skip("C0", f"t.py::test_experts[{m}]", m, "n/a: no mixture-of-experts layers") for m in ("llama", "mamba2")]
    res += [CheckRecord("t.py::test_big[qwen3]", "C0", "qwen3", "crashed", "worker gw1 crashed while running it")]
    lines = R.reasons(_verdicts(res), ["C0"])
    assert lines == ["C0 [qwen3] fail: 1 of 2 checks crashed: t.py::test_big[qwen3]",
                     "C0 [qwen3] note: crashed: worker gw1 crashed while running it [t.py::test_big[qwen3]]",
                     "C0 n/a (2 checks; llama, mamba2): no mixture-of-experts layers - test_experts"]


@pytest.mark.parametrize("nodeid, model, label", [
    ("a/t.py::test_x[llama]", "llama", "test_x"),
    ("a/t.py::test_x[llama-cuda_graphs-cuda_graphs]", "llama", "test_x[cuda_graphs-cuda_graphs]"),
    ("a/t.py::test_x[greedy-needle-9-of-12-llama]", "llama", "test_x[greedy-needle-9-of-12]"),
    ("a/t.py::test_x[a-my-model-b]", "/models/my-model", "test_x[a-b]"),
    ("a/t.py::test_stock[sum]", ALL_MODELS, "test_stock[sum]"),
    ("a/t.py::test_plain", "llama", "test_plain"),
])
def test_test_labels_drop_the_path_and_the_model(nodeid, model, label):
    assert R._test_label(nodeid, model) == label


def test_reasons_that_differ_more_than_in_one_place_stay_apart():
    assert R._joined(["stock sum showed no difference", "stock max showed no difference"]) == \
        "stock {sum, max} showed no difference"
    assert R._joined(["the engine has no prefix cache", "no chunked prefill"]) is None


# ---------------------------------------------------------------------------------------------
# short reprs in hypothesis' falsifying examples
# ---------------------------------------------------------------------------------------------
def test_what_hypothesis_prints_stays_short(tmp_path):
    from hypothesis.vendor.pretty import pretty
    from fixtures.checks import workloads as W
    from fixtures.core.contract import Request, SamplingParams
    from fixtures.models.proxies import build_proxy
    proxy = build_proxy("qwen3", "tiny", tmp_path / "p", seed=0)
    text = pretty(proxy)
    assert "\n" not in text and "Config" not in text and len(text) < 300, text
    assert text == repr(proxy) and "model='qwen3'" in text
    ids = W.random_ids(512, 37, seed=123)
    req = Request("r0", ids, SamplingParams(max_tokens=4, temperature=0.7, seed=5))
    assert pretty(req) == ("Request('r0', random_ids(512, 37, seed=123), SamplingParams(max_tokens=4, temperature=0.7, "
                           "top_p=1.0, top_k=0, seed=5, n=1, ignore_eos=True))")
    seqs = W.random_sequences(512, (40, 3, 33), seed=9)
    assert pretty(seqs) == "random_sequences(512, [40, 3, 33], seed=9)"
    assert [len(s) for s in seqs] == [40, 3, 33] and seqs == W.random_sequences(512, (40, 3, 33), seed=9)
    assert type(pickle.loads(pickle.dumps(ids))) is tuple and type(pickle.loads(pickle.dumps(seqs))) is list
    assert tuple(ids) == ids and pickle.loads(pickle.dumps(ids)) == ids


def test_a_one_line_finding_is_said_once_per_gate_without_tracebacks(write_suite):
    """An engine refusing batch-invariant mode for the model (fixtures.vllm.client.VLLMInvarianceRefused,
    `one_line_failure`) fails every check of the gate the same way: each check's failure is its
    message, no traceback, and the gate's reason says it once (vLLM 0.26 on nemotron_h: the same
    traceback in every check before)."""
    pt = write_suite({"tests_c5_invariance/test_a.py": """
import pytest

class Refused(RuntimeError):
    one_line_failure = True

@pytest.fixture
def engine():
    raise Refused('vLLM refuses batch-invariant mode for m: "batch_invariant mode is not supported for MAMBA2_ATTN."')

pytestmark = pytest.mark.C3
def test_needle_alone_equals_needle_in_batch(engine): pass
def test_same_batch_twice(engine): pass
"""})
    res = pt.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                 "--report=rep", "-m", "C3")
    res.assert_outcomes(errors=2)
    out = res.stdout.str()
    assert "def engine():" not in out and "raise Refused" not in out, out     # no traceback
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    c3 = doc["gates"]["C3"]["models"]["llama"]
    assert c3["status"] == "fail"
    assert c3["reason"].endswith('every one: setup failed: Refused: vLLM refuses batch-invariant mode for m: '
                                 '"batch_invariant mode is not supported for MAMBA2_ATTN."'), c3["reason"]
