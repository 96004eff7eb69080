"""once_per_run (fixtures.runtime.worker_files): a value the run's xdist workers share, computed by the first
that asks (C0's engine kernel inventory: an engine start and a profiled workload each worker used to
repeat). Threads stand in for the workers: the claim is a file in the shared state directory."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import pytest

from fixtures.runtime.run_state import STATE, RunState
from fixtures.runtime.worker_files import once_per_run


def _worker_config(state_dir, is_worker: bool = True):
    return types.SimpleNamespace(stash={STATE: RunState(is_worker=is_worker, state_dir=str(state_dir))})


def test_the_first_worker_computes_and_the_others_load_it(tmp_path):
    calls, got, looks = [], [], []

    def compute():
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return {"kernels": ["matmul_kernel_persistent"], "computed_by": threading.get_ident()}

    threads = [threading.Thread(target=lambda: got.append(once_per_run(_worker_config(tmp_path), "inv", compute,
                                                                        poll_s=0.01,
                                                                        while_waiting=lambda: looks.append(1))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 4 and all(g == got[0] for g in got)
    assert looks, "a waiting worker answers room requests while it waits"


def test_a_compute_that_raises_gives_the_claim_up(tmp_path):
    """The next worker computes (and here succeeds); a skip raised inside is not cached."""
    def skip():
        pytest.skip("n/a: not InventoriesKernels")
    with pytest.raises(pytest.skip.Exception):
        once_per_run(_worker_config(tmp_path), "inv", skip)
    assert once_per_run(_worker_config(tmp_path), "inv", lambda: 7) == 7


def test_a_dead_workers_claim_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "once-inv.claim").write_text(dead.stdout.strip())
    assert once_per_run(_worker_config(tmp_path), "inv", lambda: "mine", wait_s=5) == "mine"


def test_control_outside_xdist_every_caller_computes(tmp_path):
    calls = []
    for _ in range(2):
        once_per_run(_worker_config(tmp_path, is_worker=False), "inv", lambda: calls.append(1))
    assert len(calls) == 2
