"""The report survives a run that ends badly: with --report=DIR, report.json and report.md say
what finished, what did not and why, when (a) an xdist worker is killed with SIGKILL mid-check,
(b) the controller gets SIGTERM, (c) a check runs out of memory. Tiny synthetic gate checks, CPU."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ARGS = ("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider")


@pytest.fixture
def suite(write_suite):
    return write_suite


def _report(pt) -> tuple[dict, str]:
    return json.loads((pt.path / "rep" / "report.json").read_text()), (pt.path / "rep" / "report.md").read_text()


def _checks(doc) -> dict[str, dict]:
    return {c["nodeid"].rpartition("::")[2]: c for c in doc["checks"]}


def _gate(doc, gate) -> dict:
    return doc["gates"][gate]["models"]["llama"]


CRASH = """
import os, signal, time, pytest
@pytest.mark.C0
def test_no_unmapped_op(): pass     # C0's defining check (fixtures.core.gates): C0 can pass
@pytest.mark.C1
def test_c1_boom():
    os.kill(os.getpid(), signal.SIGKILL)
@pytest.mark.C1
def test_c1_ok(): pass
@pytest.mark.C2
@pytest.mark.parametrize("i", range(12))
def test_c2(i): time.sleep(0.05)
"""


def test_a_worker_killed_by_sigkill_is_named_as_crashed(suite):
    pytest.importorskip("xdist")
    pt = suite({"tests_c0_inventory/test_crash.py": CRASH})
    res = pt.runpytest_inprocess(*ARGS, "-n", "2", "--report=rep")
    assert res.ret != 0
    doc, md = _report(pt)
    run, checks = doc["run"], _checks(doc)
    boom = checks["test_c1_boom"]
    assert boom["outcome"] == "crashed", boom
    assert boom["reason"].startswith("worker gw") and "crashed (signal 9" in boom["reason"] \
        and boom["reason"].endswith("while running it"), boom
    assert boom["worker"].startswith("gw")
    assert run["status"] == "incomplete" and run["complete"] is False
    assert run["crashed"] == ["tests_c0_inventory/test_crash.py::test_c1_boom"]
    assert "test_c1_boom crashed: worker gw" in run["incomplete"]
    # the worker was replaced: everything else ran
    assert checks["test_c1_ok"]["outcome"] == "passed" and run["not_run"] == []
    c1 = _gate(doc, "C1")
    assert c1["status"] == "fail" and c1["crashed"] == ["tests_c0_inventory/test_crash.py::test_c1_boom"]
    assert "1 of 2 checks crashed" in c1["reason"] and "checks failed" not in c1["reason"]
    assert any(n.startswith("crashed: worker gw") for n in c1["notes"])
    assert _gate(doc, "C0")["status"] == "pass"
    assert "**The run is incomplete:" in md
    assert "| C1 | [Proxy model](docs/porting-guide.md#c1-proxy-model) | [ ] fail (1/2, 1 crashed) |" in md
    assert "- C1 [all models] **CRASHED** `tests_c0_inventory/test_crash.py::test_c1_boom`: worker gw" in md


def test_a_crash_without_restart_lists_the_checks_that_never_ran(suite):
    pytest.importorskip("xdist")
    pt = suite({"tests_c0_inventory/test_crash.py": CRASH})
    res = pt.runpytest_inprocess(*ARGS, "-n", "2", "--max-worker-restart=0", "--report=rep")
    assert res.ret != 0
    doc, md = _report(pt)
    run, checks = doc["run"], _checks(doc)
    assert checks["test_c1_boom"]["outcome"] == "crashed"
    assert run["status"] == "incomplete" and run["not_run"], run
    assert len(checks) == 15, "every requested check is listed, finished or not"
    for nodeid in run["not_run"]:
        c = checks[nodeid.rpartition("::")[2]]
        assert c["outcome"] == "not run" and c["reason"].startswith("never ran: worker gw"), c
        assert _gate(doc, c["gate"])["status"] != "pass"
    assert f"Did not finish ({len(run['not_run'])}):" in md


SLOW = """
import time, pytest
@pytest.mark.C0
def test_no_unmapped_op(): pass     # C0's defining check (fixtures.core.gates): C0 can pass
@pytest.mark.C1
def test_c1_slow():
    from fixtures.runtime import costs
    with costs.doing("waiting for a planted hold"):
        open({marker!r}, "w").write("running")
        time.sleep(60)
@pytest.mark.C2
@pytest.mark.parametrize("i", range(4))
def test_c2(i): time.sleep(60)
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_b_sigterm_to_the_controller_leaves_an_interrupted_report(suite, xdist):
    if xdist:
        pytest.importorskip("xdist")
    marker = Path(suite({}).path) / "running.marker"
    pt = suite({"tests_c0_inventory/test_slow.py": SLOW.replace("{marker!r}", repr(str(marker)))})
    cmd = [sys.executable, "-m", "pytest", *ARGS, "--report=rep"] + (["-n", "2"] if xdist else [])
    proc = subprocess.Popen(cmd, cwd=pt.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300    # only a cap: a starved 2-core machine can take minutes to start xdist
        while time.time() < deadline and not marker.exists() and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the slow check never started"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, out.decode(errors="replace")[-2000:]
    doc, md = _report(pt)
    run, checks = doc["run"], _checks(doc)
    assert run["status"] == "interrupted" and run["interrupted"] == "interrupted (signal 15)", run
    assert run["exitstatus"] == proc.returncode != 0
    assert checks["test_no_unmapped_op"]["outcome"] == "passed"
    assert checks["test_c1_slow"]["outcome"] == "interrupted"
    # and what it was in: its phase, and the suite's wait it was inside (fixtures.runtime.activity)
    assert re.fullmatch(r"was running when the run stopped: interrupted \(signal 15\); it was in its call for "
                        r"\d+ s: waiting for a planted hold \(\d+ s\)", checks["test_c1_slow"]["reason"]), \
        checks["test_c1_slow"]["reason"]
    c2 = [c for n, c in checks.items() if n.startswith("test_c2")]
    assert len(c2) == 4 and all(c["outcome"] in ("not run", "interrupted") for c in c2)
    assert len(run["not_run"]) >= 2 and all("test_c2[" in n for n in run["not_run"])
    assert all(c["reason"] == "never ran: interrupted (signal 15)" for c in c2 if c["outcome"] == "not run")
    assert _gate(doc, "C0")["status"] == "pass"
    assert _gate(doc, "C1")["status"] == "incomplete" and _gate(doc, "C2")["status"] == "incomplete"
    assert run["complete"] is False
    assert "**The run did not finish: interrupted (signal 15).**" in md
    assert "- status: interrupted;" in md
    assert "`tests_c0_inventory/test_slow.py::test_c2[3]`" in md


OOM = """
import pytest, torch

def _no_cuda(monkeypatch):
    for name in ("init", "_lazy_init", "current_device", "mem_get_info", "memory_allocated", "memory_reserved",
                 "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("CUDA touched on the CPU path"))

@pytest.mark.C0
def test_no_unmapped_op(): pass     # C0's defining check (fixtures.core.gates): C0 can pass

@pytest.mark.C1
def test_same_architecture_class(): pass    # C1's defining checks pass: only the OOMs keep it from a pass
@pytest.mark.C1
def test_every_layer_kind_kept(): pass

@pytest.mark.C1
def test_cuda_message(monkeypatch):
    _no_cuda(monkeypatch)
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)")

@pytest.mark.C1
def test_memory_error(monkeypatch):
    _no_cuda(monkeypatch)
    raise MemoryError()

@pytest.mark.C1
def test_cpu_allocator(monkeypatch):
    _no_cuda(monkeypatch)
    torch.empty(1 << 60, dtype=torch.uint8)

@pytest.mark.C1
def test_torch_cuda_oom(monkeypatch):
    # as on a GPU: the plugin reads this process's CUDA figures (faked here)
    fake = {"is_initialized": lambda: True, "current_device": lambda: 0,
            "mem_get_info": lambda d=None: (1 << 29, 80 << 30), "memory_allocated": lambda d=None: 3 << 30,
            "memory_reserved": lambda d=None: 4 << 30, "max_memory_allocated": lambda d=None: 5 << 30}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

@pytest.mark.C1
def test_group_of_ooms():
    # as hypothesis' FlakyFailure wraps an engine OOM raised while replaying an example
    raise ExceptionGroup("Inconsistent results from replaying a test case!", [MemoryError("first"), MemoryError("again")])

@pytest.mark.C2
def test_c2_plain_failure(): assert 1 == 2
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_c_out_of_memory_is_not_carried_out_not_a_check_failure(suite, xdist, monkeypatch):
    """A check that ran out of memory was not carried out: the suite could not compare, so its gate
    is incomplete - never fail (the stack did nothing wrong), never pass (even with its defining
    checks green) - and a plain failure beside it still fails its gate."""
    if xdist:
        pytest.importorskip("xdist")
    monkeypatch.setenv("CONFORMANCE_OOM_WAIT_S", "0")     # the CUDA OOMs are rerun once; nobody frees here
    pt = suite({"tests_c0_inventory/test_oom.py": OOM})
    res = pt.runpytest_inprocess(*ARGS, "--report=rep", *(["-n", "2"] if xdist else []))
    res.assert_outcomes(passed=3, failed=6)
    doc, md = _report(pt)
    checks = _checks(doc)
    for name in ("test_cuda_message", "test_memory_error", "test_cpu_allocator", "test_torch_cuda_oom", "test_group_of_ooms"):
        assert checks[name]["outcome"] == "not carried out: out of memory", checks[name]
    assert checks["test_group_of_ooms"]["reason"].startswith("MemoryError: first")
    assert checks["test_cuda_message"]["reason"].startswith("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert checks["test_memory_error"]["reason"].startswith("MemoryError")
    assert "DefaultCPUAllocator: can't allocate memory" in checks["test_cpu_allocator"]["reason"]
    for name in ("test_cuda_message", "test_memory_error", "test_cpu_allocator"):
        mem = checks[name]["memory"]
        assert "allocated_bytes" not in mem and "cuda_error" not in mem, mem   # CUDA never touched
        assert mem["process_max_rss_bytes"] > 0
    mem = checks["test_torch_cuda_oom"]["memory"]
    assert (mem["device"], mem["allocated_bytes"], mem["reserved_bytes"], mem["free_bytes"], mem["total_bytes"]) == \
        ("cuda:0", 3 << 30, 4 << 30, 1 << 29, 80 << 30)
    assert checks["test_torch_cuda_oom"]["reason"].startswith("OutOfMemoryError: CUDA out of memory")
    assert "cuda:0: allocated 3.00 GiB, reserved 4.00 GiB by this process, free 0.50 GiB of 80.00 GiB on the device" \
        in checks["test_torch_cuda_oom"]["reason"]
    assert checks["test_c2_plain_failure"]["outcome"] == "failed"
    c1 = _gate(doc, "C1")
    assert c1["status"] == "incomplete" and c1["label"] == "incomplete", c1
    assert c1["reason"].startswith("5 of 7 checks not carried out: test_cuda_message: out of memory; ") and \
        c1["reason"].endswith("; 2 passed"), c1["reason"]
    assert "failed" not in c1["reason"] and not c1["failed"] and len(c1["errors"]) == 5
    assert set(c1["errors"].values()) == {"not carried out: out of memory"}
    assert sum(n.startswith("not carried out: out of memory: ") for n in c1["notes"]) == 5
    c2 = _gate(doc, "C2")
    assert c2["status"] == "fail" and c2["reason"].startswith("1 of 1 checks failed")
    assert doc["run"]["status"] == "finished" and doc["run"]["complete"] is True
    assert len(doc["run"]["out_of_memory"]) == 5
    assert "| C1 | [Proxy model](docs/porting-guide.md#c1-proxy-model) | [ ] incomplete (2/7, 5 out of memory) |" in md
    assert md.count("**NOT CARRIED OUT: OUT OF MEMORY**") == 5
    assert "C1 [llama] note: not carried out: out of memory: RuntimeError: CUDA out of memory" in res.stdout.str()


RERUN = """
import pytest, torch
from fixtures.runtime import gpu_memory

class IdleEngines:
    # a worker's pool as gpu_memory sees it: 3 GiB kept idle until asked to free everything
    def __init__(self):
        self.idle = 3 << 30
    def memory_report(self):
        return {"holder": "fake engines", "held": [{"what": "idle engine", "bytes": self.idle, "pid": None,
                                                     "idle": True}] if self.idle else [], "budget": None}
    def release_idle(self, need):
        freed, self.idle = (self.idle, 0) if need is None else (0, self.idle)
        return freed

HOLDER = IdleEngines()
gpu_memory.register(HOLDER)
CALLS = {"once": 0, "always": 0, "host": 0, "raw": 0}

@pytest.mark.C1
def test_oom_once():
    CALLS["once"] += 1
    if CALLS["once"] == 1:
        assert HOLDER.idle == 3 << 30
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.27 GiB. GPU 0 has 2.08 GiB free")
    assert HOLDER.idle == 0, "the rerun came before this worker's idle engines were freed"

@pytest.mark.C1
def test_oom_always():
    CALLS["always"] += 1
    raise torch.OutOfMemoryError(f"CUDA out of memory (attempt {CALLS['always']}). Tried to allocate 1.00 GiB")

@pytest.mark.C1
def test_raw_cuda_allocation_in_a_helper_process_once():
    # as the suite's vLLM kernel worker relays a failed cudaMalloc (KernelWorkerError, a RuntimeError)
    CALLS["raw"] += 1
    if CALLS["raw"] == 1:
        raise RuntimeError("run linear: AcceleratorError: CUDA error: out of memory")

@pytest.mark.C1
def test_host_memory_error_is_not_rerun():
    CALLS["host"] += 1
    raise MemoryError(f"attempt {CALLS['host']}")
"""


def test_a_check_out_of_cuda_memory_is_rerun_once_after_freeing_idle_engines(suite, monkeypatch):
    """A CUDA OOM of the check's own allocation: this worker's idle engines are freed and the check
    runs again; it passes if the rerun fits (its costs say so), and is "not carried out: out of
    memory" with the rerun's message if not; a raw CUDA allocation's "CUDA error: out of memory" (a
    helper process's) is rerun too. A host MemoryError is not rerun (freeing GPU memory cannot help)."""
    monkeypatch.setenv("CONFORMANCE_OOM_WAIT_S", "0")
    pt = suite({"tests_c0_inventory/test_rerun.py": RERUN})
    res = pt.runpytest_inprocess(*ARGS, "--report=rep")
    res.assert_outcomes(passed=2, failed=2)
    checks = _checks(_report(pt)[0])
    raw = checks["test_raw_cuda_allocation_in_a_helper_process_once"]
    assert raw["outcome"] == "passed" and raw["costs"]["rerun after out of GPU memory"]["n"] == 1, raw
    once = checks["test_oom_once"]
    assert once["outcome"] == "passed" and once["costs"]["rerun after out of GPU memory"]["n"] == 1, once
    always = checks["test_oom_always"]
    assert always["outcome"] == "not carried out: out of memory" and "(attempt 2)" in always["reason"], always
    assert always["costs"]["rerun after out of GPU memory"]["n"] == 1
    host = checks["test_host_memory_error_is_not_rerun"]
    assert host["outcome"] == "not carried out: out of memory" and host["reason"].startswith("MemoryError: attempt 1"), host
    assert "rerun after out of GPU memory" not in (host.get("costs") or {})


def test_oom_message_sizes_are_read():
    from fixtures.runtime import gpu_memory
    assert gpu_memory.requested_bytes("CUDA out of memory. Tried to allocate 2.27 GiB. GPU 0 ...") == int(2.27 * (1 << 30))
    assert gpu_memory.requested_bytes("Tried to allocate 512.00 MiB") == 512 << 20
    assert gpu_memory.requested_bytes("out of memory") is None


def test_verdict_rules_for_crashes_oom_and_unfinished_checks():
    """A crash is a failure; an out-of-memory check was not carried out: the gate is incomplete,
    never fail (the stack did nothing wrong) and never pass (#44)."""
    from fixtures.core.gates import DefiningCheck, Gate
    from fixtures.core.verdicts import CheckRecord, all_passed, gate_verdicts, overall

    def r(gate, outcome, name, reason=""):
        return CheckRecord(f"t::{name}", gate, "m", outcome, reason)
    records = {g: Gate(g, g, "", (DefiningCheck(("a", "c", "f", "g")),)) for g in ("C0", "C1", "C2", "C3")}
    out = gate_verdicts([r("C0", "passed", "a"), r("C0", "not run", "b", "never ran: interrupted (signal 15)"),
                         r("C1", "passed", "c"), r("C1", "crashed", "d", "worker gw1 crashed (signal 9) while running it"),
                         r("C1", "failed", "e", "call failed"),
                         r("C2", "not carried out: out of memory", "f", "RuntimeError: CUDA out of memory"),
                         r("C2", "passed", "g")],
                        ["m"], ("C0", "C1", "C2", "C3"), records=records)["m"]
    assert out["C0"].status == "incomplete" and out["C0"].unfinished == ["t::b"]
    assert out["C0"].reason == "1 of 2 checks did not finish: never ran: interrupted (signal 15); 1 passed"
    assert out["C1"].status == "fail" and out["C1"].crashed == ["t::d"] and out["C1"].failed == ["t::d", "t::e"]
    assert out["C1"].reason == "1 of 3 checks crashed: t::d; 1 of 3 checks failed: t::e"
    assert out["C1"].notes == ["crashed: worker gw1 crashed (signal 9) while running it [t::d]"]
    assert out["C2"].status == "incomplete" and out["C2"].errors == {"t::f": "not carried out: out of memory"}
    assert out["C2"].reason == "1 of 2 checks not carried out: f: out of memory; 1 passed"
    assert out["C2"].notes == ["not carried out: out of memory: RuntimeError: CUDA out of memory [t::f]"]
    assert out["C2"].as_dict()["errors"] == {"t::f": "not carried out: out of memory"}
    assert not out["C2"].passed
    assert not all_passed({"m": out}, ["C0"])
    assert overall({"m": out, "n": {"C0": type(out["C0"])("C0", "n", "not run")}}, "C0") == "incomplete"


def test_b_sigterm_seen_through_xdists_queue_lock_is_one_line(capsys):
    """Measured on the H200: SIGTERM landing inside xdist's queue.get surfaced as RuntimeError
    ("release unlocked lock") and pytest printed an INTERNALERROR traceback, exit status 3. After
    our signal an internal error is one line, and the exit status is INTERRUPTED."""
    import types
    from fixtures.plugin.results import ReportCollector
    from fixtures.runtime.run_state import STATE, RunState
    config = types.SimpleNamespace(stash={STATE: RunState(signalled=15)})
    collector = ReportCollector(config)
    try:
        raise RuntimeError("release unlocked lock")
    except RuntimeError:
        excinfo = pytest.ExceptionInfo.from_current()
    assert collector.pytest_internalerror(None, excinfo) is True
    assert capsys.readouterr().err.strip() == ("run interrupted by signal 15 (RuntimeError: release unlocked lock "
                                               "while xdist waited for its workers)")
    config.stash[STATE].signalled = None
    assert collector.pytest_internalerror(None, excinfo) is None, "a real internal error keeps its traceback"
