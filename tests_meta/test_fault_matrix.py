"""The planted-fault matrix: every fault in fixtures.faults.catalog goes red at its gate, not earlier.

Each row switches one fault in (`-p fixtures.plugin.faults --plant-fault NAME`) and runs the real
gate chain (`--upto <the fault's gate>`) on one tiny proxy, then reads the verdicts:
- every gate before the fault's gate that has checks today must have all of them pass
  (the fault must not trip an earlier gate - that would be a mis-attributed catch);
- the fault's own gate, once it has checks, must fail, and (for a localisable fault) its failure
  text must name the place: the op (or its kernel), for a trainer-gradient fault the parameter,
  for a decode-row fault the vocabulary id (docs/fault-matrix.md has the table).
A gate with no checks yet is not reached: the row then checks only the earlier gates and says so
in a MatrixPending warning, and becomes fully checked as that gate arrives - no edit needed here.

Speed: a row runs every check of every gate up to the fault's gate, which takes minutes once the
engine gates exist (C2 alone is about a minute on the CPU lane). By default ('quick') the chain runs
for the QUICK rows - one per kind, up to C1 - and the other rows say how to run them; `-p fixtures.plugin.faults --fault-matrix full`
runs every row up to its gate. The inner runs happen in this process (pytest.main, see _run_chain).

Beside it, the faults are checked directly where their component can be driven without the
later gates: engine faults through a stub Engine (they fire at their threshold, and only there);
module and trainer faults through the localisation in tests_meta/test_localise.py.
"""
from __future__ import annotations

import json
import time
import tomllib
import warnings

from fixtures.faults.catalog import MatrixPending  # importable by the xdist controller, which rebuilds warnings
from pathlib import Path

import pytest
import torch

from fixtures.core import environment

from fixtures.faults import catalog as faults
from fixtures.core.contract import Completion, EngineStats, Request, Sample, SamplingParams
from fixtures.faults.catalog import FAULTS, FaultUnavailable
from fixtures.core.gates import GATE_ORDER, gate_index

ROOT = Path(__file__).resolve().parents[1]

QUICK = {                         # fault -> the last gate the quick run goes to (C2 alone takes ~1 min)
    "matmul_split_k_rows": "C1",  # kernel: swapped for the session, C0..C1 stay green
    "trainer_gemm_tiling": "C1",  # trainer module: must leave C0..C1 green (its gate is C7)
    "moe_batch_activation_scale": "C1",   # engine module (MoE proxy): C0..C1 green
}




def _gate_paths() -> list[str]:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return [str(ROOT / p) for p in ini.get("testpaths", []) if (ROOT / p).is_dir()]


class _Reports:
    """Collects the inner run's test reports (the plugin writes the verdicts to report.json)."""

    def __init__(self):
        self.reports = []

    def pytest_runtest_logreport(self, report):
        self.reports.append(report)


def _run_chain(tmp_path, fault, upto: str, *, model: str | None = None) -> tuple[dict, dict[str, list[str]]]:
    """_run_chain_here in a forked child: the inner pytest.main keeps this process's imports (fast)
    but none of its state - a pytest-xdist worker's modules and sys.path stay untouched."""
    import os
    import traceback
    out = tmp_path / f"chain-{fault.name if fault else 'baseline'}-{upto}.json"
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            verdicts, texts = _run_chain_here(tmp_path, fault, upto, model=model)
            out.write_text(json.dumps({"verdicts": verdicts, "texts": texts}, default=str))
        except BaseException:
            out.write_text(json.dumps({"error": traceback.format_exc()}))
            code = 1
        finally:
            os._exit(code)
    os.waitpid(pid, 0)
    assert out.is_file(), f"the inner run for {fault.name if fault else 'baseline'} left no result"
    doc = json.loads(out.read_text())
    if "error" in doc:
        pytest.fail(f"inner run failed:\n{doc['error']}")
    return doc["verdicts"], doc["texts"]


def _run_chain_here(tmp_path, fault, upto: str, *, model: str | None = None) -> tuple[dict, dict[str, list[str]]]:
    """Run C0..upto in-process with `fault` planted (None: no fault, the baseline);
    (gate -> verdict dict, gate -> failure texts).

    pytest.main in this process, not pytester: inline_run drops every module first imported during
    the run (transformers' lazily imported modules, torch._dynamo), which then cannot be imported
    again by the next row; runpytest_subprocess costs 10-25 s of imports per row.
    """
    from hypothesis import settings
    model = model or fault.model
    report = tmp_path / f"report-{fault.name if fault else 'baseline'}"
    saved_env, saved_profile = dict(environment._session), settings._current_profile
    rec = _Reports()
    plant = ["--plant-fault", fault.name] if fault else []
    try:
        ret = pytest.main(
            ["-p", "fixtures.plugin.faults", *plant, "--model", model, "--upto", upto, "--report", str(report), "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
             "--basetemp", str(tmp_path / "inner"), "-p", "no:cacheprovider", "--hypothesis-profile",
             "fault-matrix", "-q", *_gate_paths()], plugins=[rec])
    finally:
        environment._session.update(saved_env)
        if saved_profile:
            settings.load_profile(saved_profile)
    assert ret in (0, 1) and (report / "report.json").is_file(), f"inner run did not complete (exit {ret})"
    doc = json.loads((report / "report.json").read_text())
    # the requested gates; one model a run (a family's name is reported as its config dir)
    verdicts = {g: next(iter(doc["gates"][g]["models"].values())) for g in doc["gates"]}
    texts: dict[str, list[str]] = {}
    for rep in rec.reports:
        if rep.failed:
            gate = dict(rep.user_properties).get("gate", "?")
            texts.setdefault(gate, []).append(f"{rep.nodeid}: {rep.longreprtext}")
    return verdicts, texts


ROWS = [pytest.param(f.name, id=f"{f.name}@{f.gate}") for f in FAULTS.values()]


@pytest.mark.parametrize("name", ROWS)
def test_chain_goes_red_at_the_faults_gate(name, tmp_path, pytestconfig):
    fault = FAULTS[name]
    full = pytestconfig.getoption("--fault-matrix", "quick") == "full"
    if not full and name not in QUICK:
        pytest.skip(f"quick matrix: {name}'s chain (C0..{fault.gate}) runs with "
                    "-p fixtures.plugin.faults --fault-matrix full")
    if fault.kind == "kernel":
        try:
            fault.plant(None)()
        except FaultUnavailable as exc:
            pytest.fail(f"cannot plant {fault.name}: {exc}")
    upto = fault.gate if full else min(fault.gate, QUICK[name], key=gate_index)
    t0 = time.perf_counter()
    verdicts, texts = _run_chain(tmp_path, fault, upto)
    took = time.perf_counter() - t0
    table = "\n".join(f"  {g}: {verdicts[g]['status']} {verdicts[g]['counts']} {verdicts[g]['reason'][:160]}"
                      for g in GATE_ORDER[:gate_index(upto) + 1])
    ctx = f"planted fault {fault.name} ({fault.kind}) - expected {fault.expectation()}; C0..{upto} in {took:.1f}s:\n{table}"
    earlier = [g for g in GATE_ORDER[:gate_index(fault.gate)] if g in verdicts and gate_index(g) <= gate_index(upto)
               and verdicts[g]["counts"]]
    for g in earlier:
        counts = verdicts[g]["counts"]
        if counts.get("failed"):
            base, _ = _run_chain(tmp_path, None, g, model=fault.model)
            if base[g]["counts"].get("failed"):
                pytest.fail(f"{g} is red for {fault.model} WITHOUT any planted fault ({base[g]['reason'][:300]}): "
                            f"the matrix cannot tell whether {fault.name} trips it; fix {g} first\n{ctx}")
        assert not counts.get("failed"), (
            f"{g} went red with {fault.name} planted, before its gate {fault.gate} (caught too early; "
            f"green without the fault):\n{ctx}\n" + "\n".join(texts.get(g, []))[:4000])
        assert counts.get("passed"), f"{g} ran checks but none passed with {fault.name} planted:\n{ctx}"
    mine = verdicts.get(fault.gate, {"counts": {}})   # a quick matrix stops before the gate: not requested
    if upto != fault.gate or not mine["counts"]:
        why = "was not run (quick matrix)" if upto != fault.gate else "has no checks yet"
        warnings.warn(MatrixPending(
            f"{fault.name}: its gate {fault.gate} {why}; checked only that "
            f"{', '.join(earlier) or 'no earlier gate'} stay green with it planted"))
        return
    assert mine["counts"].get("failed"), (
        f"{fault.name} did not fire: {fault.gate} stayed green with it planted, so its checks never reach "
        f"the condition this fault needs ({fault.description})\n{ctx}")
    if fault.localisable:
        failure = "\n".join(texts.get(fault.gate, []))
        names = [fault.op] + [n for n in (getattr(fault, "kernel", ""), getattr(fault, "variant", ""))
                              if isinstance(n, str) and n]      # a module fault's variant is a function
        assert any(_names(failure, n) for n in names), (
            f"{fault.gate} caught {fault.name} but its failure does not name {' or '.join(names)}: both sides "
            f"of that check can be traced, so it must say where they part (assert_bitwise(..., "
            f"localise=...) with fixtures.diagnose.localise):\n{failure[:4000]}")


def _names(text: str, name: str) -> bool:
    """`name` appears in `text` as a word ('kernel: matmul', "KERNELS['matmul']", 'aten.mm ...')."""
    import re
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None
