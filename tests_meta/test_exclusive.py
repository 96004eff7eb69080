"""The device to one check alone (fixtures.plugin.exclusive), in real `-n 3` runs: no other worker's
check overlaps the block a check holds the device for, and the negative control - the same timed
block without asking - is seen to overlap. CPU only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import json, os, time, pytest
from fixtures.plugin.exclusive import alone

def _log(name, t0, t1, extra=None):
    with open(os.path.join({out!r}, name + ".json"), "w") as f:
        json.dump({{"t0": t0, "t1": t1, "worker": os.environ.get("PYTEST_XDIST_WORKER"), **(extra or {{}})}}, f)

@pytest.mark.C0
def test_c0_timed_alone(pytestconfig):
    time.sleep(0.6)                      # the others are running checks by now
    with alone(pytestconfig) as device:
        t0 = time.time(); time.sleep(1.0); t1 = time.time()
    _log("alone", t0, t1, {{"alone": device.alone, "others": device.others, "describe": device.describe()}})

@pytest.mark.C0
def test_c0_timed_without_asking():
    time.sleep(0.6)
    t0 = time.time(); time.sleep(1.0); t1 = time.time()
    _log("unasked", t0, t1)

@pytest.mark.C0
@pytest.mark.parametrize("i", range(40))
def test_c0_neighbour(i):
    t0 = time.time(); time.sleep(0.25); t1 = time.time()
    _log(f"n{{i}}", t0, t1)
"""


def _overlaps(a, b) -> bool:
    return a["t0"] < b["t1"] and b["t0"] < a["t1"]


def test_no_check_of_another_worker_runs_while_one_holds_the_device(write_suite, tmp_path):
    pytest.importorskip("xdist")
    out = tmp_path / "log"
    out.mkdir()
    pt = write_suite({"tests_c0_inventory/test_alone.py": SUITE.format(out=str(out))})
    res = pt.runpytest_subprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                  "-n", "3", "--report=rep", "tests_c0_inventory")
    res.assert_outcomes(passed=42)
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    held = [c for c in doc["checks"] if "held while another check had the device" in (c.get("costs") or {})]
    assert held, "no check was held (or its wait was not in its costs)"
    logs = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    window = logs.pop("alone")
    unasked = logs.pop("unasked")
    assert window["alone"] is True and window["others"] == 2, window
    assert "alone: the run's 2 other worker(s) held between checks" in window["describe"], window
    others = [v for v in logs.values() if v["worker"] != window["worker"]]
    assert others and not [v for v in others if _overlaps(v, window)], (window, others)
    # the negative control: the same block without asking runs beside other workers' checks
    assert [v for v in logs.values() if v["worker"] != unasked["worker"] and _overlaps(v, unasked)], unasked


def test_a_worker_still_busy_after_the_wait_is_said(tmp_path, monkeypatch):
    """A neighbour whose check does not end within the wait: the block goes on and says it was
    shared, naming the worker (C10 then refuses a --min-throughput-ratio verdict). The marker of a
    worker whose process is gone is not waited for."""
    from fixtures.plugin import exclusive

    from fixtures.plugin.state import STATE

    class Config:                        # an xdist worker's config, as far as the module reads it
        workerinput = {"workerid": "gw0"}
        stash = {STATE: {"state_dir": str(tmp_path), "is_worker": True}}
    config = Config()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CONFORMANCE_GPU_WORKERS", raising=False)
    (tmp_path / "busy-machine-gw1").write_text(str(os.getpid()))          # alive: waited for
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "busy-machine-gw2").write_text(str(gone.pid))             # a crashed worker's marker: ignored
    t0 = time.monotonic()
    with exclusive.alone(config, wait_s=0.5) as device:
        assert (tmp_path / "alone-machine.lock").read_text() == "gw0"
    assert time.monotonic() - t0 >= 0.5
    assert not device.alone and device.still_busy == ["gw1"], device
    assert device.describe().startswith("SHARED: gw1 still running a check"), device.describe()
    assert not (tmp_path / "alone-machine.lock").exists()
    # a neighbour that starts during the block (it waits at most HELD_MAX_S for a hold): shared too
    (tmp_path / "busy-machine-gw1").unlink()
    with exclusive.alone(config, wait_s=0.5) as device:
        assert device.alone
        (tmp_path / "busy-machine-gw1").write_text(str(os.getpid()))
    assert not device.alone and device.during and device.still_busy == ["gw1"], device
    assert device.describe().startswith("SHARED: gw1 started a check during the timing"), device.describe()
