"""The xdist scheduler by engine configuration (fixtures.plugin.scheduling): checks that declare
the same engine configuration run on one worker, nothing runs twice or never, and a worker that
would otherwise idle still takes another worker's checks at the end."""
from __future__ import annotations

import types

import pytest

from fixtures.plugin import scheduling as S

pytest_plugins = ["pytester"]


class _Node:
    def __init__(self, name):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True

    def __repr__(self):
        return self.gateway.id


def test_affinity_keys_come_from_both_marks_per_model():
    """What a check starts (engine_config, a string or a function of its parameters) or shares
    (shared_setup) is its key, with its model; a check with neither has none."""
    def item(params, **marks):
        found = {name: types.SimpleNamespace(args=(arg,)) for name, arg in marks.items()}
        return types.SimpleNamespace(callspec=types.SimpleNamespace(params=params),
                                     get_closest_marker=lambda name: found.get(name))
    assert S.affinity_key(item({"model_name": "qwen3"}, shared_setup="c8 float64 reference")) == \
        "qwen3:c8 float64 reference"
    assert S.affinity_key(item({"model_name": "qwen3", "budget": 7},
                               engine_config=lambda p: f"max_num_batched_tokens={p['budget']}")) == \
        "qwen3:max_num_batched_tokens=7"
    assert S.affinity_key(item({"model_name": "llama"})) is None


def test_pick_prefers_own_keys_then_unowned_and_steals_last():
    keys = {0: "m:a", 1: None, 2: "m:b", 3: "m:a", 4: None, 5: "m:b"}
    owner: dict = {}
    n1, n2 = object(), object()
    assert S.pick([0, 1, 2, 3, 4, 5], 2, n1, keys.get, owner) == [0, 1] and owner == {"m:a": n1}
    assert S.pick([2, 3, 4, 5], 2, n2, keys.get, owner) == [2, 4], "n1's key is skipped"
    assert owner == {"m:a": n1, "m:b": n2}
    assert S.pick([3, 5], 1, n1, keys.get, owner) == [3]
    assert S.pick([5], 1, n1, keys.get, owner) == [5], "nothing else left: n2's key is taken rather than idle"


def _run_schedule(names: list[str], keys: dict[str, str], workers: int = 3, durations=None):
    """Drive the scheduler as xdist's DSession does, each worker finishing its oldest check in turn."""
    config = types.SimpleNamespace(getoption=lambda name: 1 if name == "maxschedchunk" else None,
                                   getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    sched = S.engine_affinity_scheduler(config, None, lambda: keys)
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, names)
    sched.schedule()
    ran: dict[str, str] = {}
    for _ in range(10 * len(names)):
        busy = [n for n in nodes if sched.node2pending[n]]
        if not busy:
            break
        n = busy[len(ran) % len(busy)]          # round-robin over the busy workers
        i = sched.node2pending[n][0]
        assert names[i] not in ran, f"{names[i]} ran twice"
        ran[names[i]] = n.gateway.id
        sched.mark_test_complete(n, i, duration=1.0)
    return ran, sched


def test_scheduler_keeps_each_engine_configuration_on_one_worker():
    names = [f"t{i}" for i in range(30)]
    keys = {f"t{i}": f"m:k{i % 4}" for i in range(0, 30, 2)}      # every other check declares one of 4 configs
    ran, sched = _run_schedule(names, keys)
    assert sorted(ran) == sorted(names) and sched.tests_finished, "every check ran exactly once"
    by_key: dict[str, set] = {}
    for name, worker in ran.items():
        if name in keys:
            by_key.setdefault(keys[name], set()).add(worker)
    assert all(len(w) == 1 for w in by_key.values()), by_key
    assert len({w for w in ran.values()}) == 3, "every worker got work"


SUITE = """
import os, pytest

def _note(name):
    with open(os.path.join({out!r}, name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main"))

@pytest.mark.C0
@pytest.mark.parametrize("j", range(2))
@pytest.mark.shared_setup("float64 reference")
def test_c0_shared(j):
    _note(f"shared-{{j}}")

@pytest.mark.C0
@pytest.mark.parametrize("b", [1, 2, 3, 4])
@pytest.mark.engine_config(lambda p: f"budget={{p['b']}}")
def test_c0_chunked(b):
    _note(f"chunked-{{b}}")

@pytest.mark.C0
@pytest.mark.parametrize("b", [1, 2, 3, 4])
@pytest.mark.engine_config(lambda p: f"budget={{p['b']}}")
def test_c0_budget(b):
    _note(f"budget-{{b}}")

@pytest.mark.C0
@pytest.mark.parametrize("i", range(8))
def test_c0_other(i):
    _note(f"other-{{i}}")

"""


def test_xdist_run_puts_one_configuration_on_one_worker(write_suite, tmp_path):
    """The plugin wired into a real `-n 2` run: each budget's two checks on one worker, and the two
    checks sharing a setup."""
    pytest.importorskip("xdist")
    out = tmp_path / "ran"
    out.mkdir()
    pt = write_suite({"tests_c0_inventory/test_affinity.py": SUITE.format(out=str(out))})
    result = pt.runpytest_subprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                     "-n", "2", "tests_c0_inventory")
    result.assert_outcomes(passed=18)
    ran = {p.name: p.read_text() for p in out.iterdir()}
    assert len(ran) == 18
    for b in range(1, 5):
        assert ran[f"chunked-{b}"] == ran[f"budget-{b}"], ran
    assert ran["shared-0"] == ran["shared-1"], ran       # a shared session fixture: one worker too
