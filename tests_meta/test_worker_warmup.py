"""An xdist worker is readied before its first check (`prepare_process`, fixtures.plugin.session):
the vLLM adapter's spare engine workers start importing vLLM at configure time.

Why: on the H200 (2026-12-03, qwen3 `--upto C10 -n 4`) 305 of the 616 s of engine starts waited
for a worker process's vLLM import; a start on a ready spare took 5-7 s, one on a spare still
importing 17-54 s, and a worker's first starts had no spare at all. Fake workers: no GPU, no vLLM."""
from __future__ import annotations

import os

import pytest

from fixtures.core.contract import EngineSettings
from fixtures.vllm.ipc import env_key, worker_env

pytest_plugins = ["pytester"]


def test_prepare_process_starts_a_spare_for_each_environment_and_the_first_start_takes_one(fake_vllm_impl, fake_model_dir):
    fake_vllm_impl.pool.prespawn = True          # the fake backend alone turns pre-spawning off
    fake_vllm_impl.prepare_process()
    expected = {env_key(worker_env(EngineSettings(), fake="echo")),
                env_key(worker_env(EngineSettings(batch_invariant=False), fake="echo"))}
    assert set(fake_vllm_impl.pool.spares) == expected
    with fake_vllm_impl.make_engine(fake_model_dir, EngineSettings(batch_invariant=False)) as control:
        assert control.engine.alive
    with fake_vllm_impl.make_engine(fake_model_dir) as engine:
        assert engine.engine.alive
    assert fake_vllm_impl.pool.spares_used == 2, "both first starts ran on a worker spawned at configure time"


def test_without_pre_spawning_prepare_process_starts_nothing(fake_vllm_impl):
    fake_vllm_impl.prepare_process()
    assert fake_vllm_impl.pool.spares == {}


IMPL = """
import os
from fixtures.reference.implementation import ReferenceImplementation

class Prepared(ReferenceImplementation):
    def prepare_process(self):
        with open(os.path.join(os.environ["PREPARED_DIR"], f"prepared-{os.getpid()}"), "w") as f:
            f.write(os.environ.get("PYTEST_XDIST_WORKER", "-"))

def make():
    return Prepared()
"""

SUITE = """
import pytest

@pytest.mark.C0
def test_one(): pass

@pytest.mark.C0
def test_two(): pass
"""


@pytest.mark.parametrize("args, prepared", [
    (["-n", "2"], ["gw0", "gw1"]),             # each worker, never the controller
    (["-n", "2", "--collect-only"], []),       # nothing will run
    ([], []),                                  # a plain run: its first check is its first start
], ids=["xdist", "collect-only", "plain"])
def test_each_xdist_worker_is_prepared_before_its_checks(write_suite, monkeypatch, args, prepared):
    pytest.importorskip("xdist")
    pt = write_suite({"prepared_impl.py": IMPL, "tests_c0_inventory/test_prepared.py": SUITE})
    monkeypatch.setenv("PYTHONPATH", f"{pt.path}{os.pathsep}{os.environ['PYTHONPATH']}")
    monkeypatch.setenv("PREPARED_DIR", str(pt.path))
    res = pt.runpytest_subprocess("-p", "fixtures.plugin.session", "--impl", "prepared_impl:make", "--model", "llama",
                                 "-p", "no:cacheprovider", "-m", "C0", *args)
    assert res.ret in ((pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) if "--collect-only" in args
                       else (pytest.ExitCode.OK,)), res.stdout.str()[-2000:]
    got = sorted(p.read_text() for p in pt.path.glob("prepared-*"))
    assert got == prepared
