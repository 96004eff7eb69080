"""The device to one check alone (fixtures.runtime.exclusive), in real `-n 3` runs: no other worker's
check overlaps the block a check holds the device for, and the negative control - the same timed
block without asking - is seen to overlap. CPU only."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import json, os, time, pytest
from fixtures.runtime.exclusive import alone

def _log(name, t0, t1, extra=None):
    with open(os.path.join({out!r}, name + ".json"), "w") as f:
        json.dump({{"t0": t0, "t1": t1, "worker": os.environ.get("PYTEST_XDIST_WORKER"), **(extra or {{}})}}, f)

@pytest.mark.C0
def test_c0_timed_alone(pytestconfig):
    time.sleep(0.6)                      # the others are running checks by now
    warm = []
    def meanwhile():
        warm.append(time.time()); time.sleep(0.3)
    with alone(pytestconfig, meanwhile=meanwhile) as device:
        t0 = time.time(); time.sleep(1.0); t1 = time.time()
    _log("alone", t0, t1, {{"alone": device.alone, "others": device.others, "describe": device.describe(),
                            "meanwhile_t0": warm[0]}})

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
    assert "of it warming up; " in window["describe"], window
    # when the others' running checks ended after the lock (the first slept 0.6 s while they ran 0.25 s
    # checks): said, or that none was running one
    assert re.search(r"their running checks ended [0-9., ]+ s after the lock|none was running a check at the lock",
                     window["describe"]), window
    others = [v for v in logs.values() if v["worker"] != window["worker"]]
    assert others and not [v for v in others if _overlaps(v, window)], (window, others)
    # the work that needs no quiet device ran with the lock taken: no other worker's check began in it
    assert not [v for v in others if window["meanwhile_t0"] <= v["t0"] <= window["t1"]], (window, others)
    # the report's per-worker timeline: every check carries its worker, span and its process's CPU seconds,
    # and the time section says it
    spans = [c for c in doc["checks"] if c.get("worker", "").startswith("gw") and len(c.get("span_s", [])) == 2
             and c.get("cpu_s", -1) >= 0]
    assert len(spans) == 42, [c for c in doc["checks"] if c not in spans][:3]
    assert "- workers (last to end first): gw" in (pt.path / "rep" / "report.md").read_text()
    # the negative control: the same block without asking runs beside other workers' checks
    assert [v for v in logs.values() if v["worker"] != unasked["worker"] and _overlaps(v, unasked)], unasked


def test_a_worker_still_busy_after_the_wait_is_said(tmp_path, monkeypatch):
    """A neighbour whose check does not end within the wait: the block goes on and says it was
    shared, naming the worker (C10 then refuses a --min-throughput-ratio verdict). The marker of a
    worker whose process is gone is not waited for."""
    from fixtures.runtime import exclusive

    from fixtures.runtime.run_state import STATE, RunState

    class Config:                        # an xdist worker's config, as far as the module reads it
        workerinput = {"workerid": "gw0"}
        stash = {STATE: RunState(state_dir=str(tmp_path), is_worker=True)}
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


def test_a_room_request_is_answered_once_by_each_live_neighbour_and_lasts_for_its_check(tmp_path, monkeypatch):
    """DeviceRoom (fixtures.runtime.exclusive): the asking worker holds the device's lock marked as
    a room request; a live neighbour that meets it gives up its memory once (its holders'
    release_for_neighbour) and says so; a crashed worker's marker is not waited for; a timed block
    inside the same check does not wait for its own lock; the lock goes when the check ends."""
    import weakref

    from fixtures.runtime import gpu_memory
    from fixtures.runtime import exclusive
    from fixtures.runtime.run_state import STATE, RunState

    def config(wid):
        class Config:                    # an xdist worker's config, as far as the module reads it
            workerinput = {"workerid": wid}
            stash = {STATE: RunState(state_dir=str(tmp_path), is_worker=True)}
        return Config()

    class Engines:                       # a worker's engine pool, as gpu_memory sees it
        given = 0

        def memory_report(self):
            return {"holder": "test", "held": [], "budget": None}

        def release_idle(self, need_bytes):
            return 0

        def release_for_neighbour(self):
            self.given += 1
            return 3 << 30
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for name in ("CUDA_VISIBLE_DEVICES", "CONFORMANCE_GPU_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    engines = Engines()
    monkeypatch.setattr(gpu_memory, "_holders", weakref.WeakSet([engines]))
    asking, neighbour = config("gw0"), config("gw1")
    here, there = exclusive._where(asking), exclusive._where(neighbour)
    exclusive._alive(here, True)
    exclusive._alive(there, True)                                    # gw1: this process, alive
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "worker-machine-gw2").write_text(str(gone.pid))      # a crashed worker's marker
    room = exclusive.DeviceRoom(asking)
    try:
        assert room.pending() == [], "no request yet"
        assert room.hold() and room.hold(), "held, and held again by the same check"
        lock = (tmp_path / "alone-machine.lock").read_text()
        assert lock.startswith("gw0\nroom gw0:") and exclusive._holder(here) == "gw0"
        assert room.pending() == ["gw1"]
        exclusive._answer_room(here)                                 # the asker never answers itself
        assert engines.given == 0
        exclusive._answer_room(there)
        exclusive._answer_room(there)                                # once per request
        assert engines.given == 1 and room.pending() == []
        with exclusive.alone(asking, wait_s=0.5) as device:          # C10 inside the same check
            assert device.alone and (tmp_path / "alone-machine.lock").exists()
        assert (tmp_path / "alone-machine.lock").exists(), "the hold lasts for the rest of the check"
    finally:
        exclusive.release_room()
    assert not (tmp_path / "alone-machine.lock").exists()
    assert exclusive.DeviceRoom(config("gw0")).pending() == []       # no request: nothing pending
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert not exclusive.DeviceRoom(asking).hold(), "no other worker: nothing to ask"
