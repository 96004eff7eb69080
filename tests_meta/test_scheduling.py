"""The xdist scheduler by engine configuration (fixtures.runtime.scheduling): checks that declare
the same engine configuration run on one worker, nothing runs twice or never, and a worker that
would otherwise idle still takes another worker's checks at the end."""
from __future__ import annotations

import types

import pytest

from fixtures.runtime import scheduling as S

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


def test_pick_defers_slow_checks_while_the_device_alone_window_is_open():
    """Deferred checks (slow ones while a device-alone check is open) go after every other check of
    the worker's own or free keys, and still go rather than leave the worker idle."""
    keys = {0: None, 1: "m:a", 2: None, 3: None}
    owner: dict = {}
    n1 = object()
    slow = {0, 1}
    assert S.pick([0, 1, 2, 3], 2, n1, keys.get, owner, defer=slow.__contains__) == [2, 3]
    assert owner == {}, "a deferred check's key is not taken"
    assert S.pick([0, 1], 2, n1, keys.get, owner, defer=slow.__contains__) == [0, 1], "nothing else: no idling"
    assert S.pick([0, 1, 2, 3], 2, object(), keys.get, {}) == [0, 1], "control: without the window, pending order"


def _run_schedule(names: list[str], keys: dict[str, str], workers: int = 3, paces=None, sent=None):
    """Drive the scheduler as xdist's DSession does, each worker finishing its oldest check in turn.
    `sent`: a list that gets (check, worker, whether a device-alone check was open) per check sent."""
    config = types.SimpleNamespace(getoption=lambda name: 1 if name == "maxschedchunk" else None,
                                   getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    sched = S.engine_affinity_scheduler(config, None, lambda: keys,
                                        lambda: paces or {"slow": set(), "alone": set()})
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    if sent is not None:
        for n in nodes:
            def send(indices, n=n):
                open_ = sched.window_open()
                sent.extend((names[i], n.gateway.id, open_) for i in indices)
                n.sent.extend(indices)
            n.send_runtest_some = send
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


@pytest.mark.parametrize("window", [True, False], ids=["window", "control-no-alone-check"])
def test_no_slow_check_starts_beside_an_open_device_alone_check(window):
    """Collected as the plugin orders them under xdist (the device-alone C10 first, the slow ones
    next): while C10 is pending or running no other worker is sent a slow check, while short ones
    are left. Control: without a device-alone check the other workers take the slow ones at once."""
    names = ["c10", "q0", "slow1", "q1", "slow2", "q2", *[f"q{i}" for i in range(3, 12)], "slow3"]
    slow = {"c10", "slow1", "slow2", "slow3"}
    sent: list = []
    ran, sched = _run_schedule(names, {}, workers=3, paces={"slow": slow, "alone": {"c10"} if window else set()},
                               sent=sent)
    assert sorted(ran) == sorted(names), "every check ran exactly once"
    beside = [(name, w) for name, w, open_ in sent if name in slow and name != "c10" and open_]
    if window:
        assert sent[0][:2] == ("c10", "gw0")
        assert not beside, f"slow checks sent while the device-alone check was open: {beside}"
        assert any(open_ for _, _, open_ in sent[1:]), "the window was open while short checks were sent"
    else:
        first = {name for name, _, _ in sent[:6]}
        assert {"slow1", "slow2"} <= first, f"control: the slow checks go first without a window ({sent[:6]})"


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


def test_the_engine_kernel_inventory_and_its_c2_checks_share_one_worker():
    """C0's engine-kernel checks and C2's checks of the engine's own kernels declare one
    shared_setup key (the profiled inventory both need, the kernel worker processes C2 starts), so
    one xdist worker runs them back to back; control: C2's checks of the suite's own kernels
    (test_c2_kernels.py, no engine) declare none."""
    import tests_c0_inventory.test_c0_engine_kernels as c0
    import tests_c5_invariance.test_c2_kernels as c2_own
    import tests_c5_invariance.test_c2_vllm_kernels as c2

    def shared(module):
        marks = module.pytestmark if isinstance(module.pytestmark, list) else [module.pytestmark]
        return [m.args[0] for m in marks if m.name == S.SETUP_MARK]
    assert shared(c0) == shared(c2) == [S.ENGINE_KERNEL_SETUP]
    assert shared(c2_own) == []


def _timed_run(durations: dict[str, float], slow: set[str], alone: set[str], workers: int, old_rule: bool = False,
               keys: dict[str, str] | None = None, key_start: float = 0.0):
    """Drive the scheduler in simulated time: the worker whose running check ends first finishes it.
    Returns (makespan, [(check, worker, what that worker was running then)] for every check sent,
    {worker: end}). A worker's first check of a key costs `key_start` more (its engine's start).
    old_rule: the window's deferral alone (before the next-slot rule), the control."""
    names, keys = list(durations), keys or {}
    config = types.SimpleNamespace(getoption=lambda name: 1 if name == "maxschedchunk" else None,
                                   getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    sched = S.engine_affinity_scheduler(config, None, lambda: keys, lambda: {"slow": slow, "alone": alone})
    if old_rule:
        sched._deferred = lambda node: ((lambda i: names[i] in slow and names[i] not in alone)
                                        if sched.window_open() else None)
        sched._left_to_its_owner = lambda node, i: False
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    sent: list = []
    for n in nodes:
        def send(indices, n=n):
            queued = [names[i] for i in sched.node2pending[n] if i not in indices]
            sent.extend((names[i], n.gateway.id, queued[:1]) for i in indices)
        n.send_runtest_some = send
        sched.add_node(n)
        sched.add_node_collection(n, names)
    sched.schedule()
    now, ends, started, last = 0.0, {}, {n: set() for n in nodes}, {}
    while True:
        for n in nodes:      # a worker starts the first of its pending checks
            if sched.node2pending[n] and n not in ends:
                name = names[sched.node2pending[n][0]]
                key = keys.get(name)
                ends[n] = now + durations[name] + (key_start if key and key not in started[n] else 0.0)
                started[n].add(key)
        if not ends:
            return now, sent, last
        n = min(ends, key=ends.get)
        now = last[n.gateway.id] = ends.pop(n)
        sched.mark_test_complete(n, sched.node2pending[n][0], duration=1.0)


@pytest.mark.parametrize("old_rule", [False, True], ids=["next-slot-rule", "control-window-only"])
def test_a_slow_check_is_not_queued_behind_a_slow_one(old_rule):
    """The H200's shape (qwen3 `-n 4`, 2026-12-05): C10 times alone first, the slow checks wait for
    its window, then start together as it closes. A slow check is never committed as the next of a
    worker running a slow one while a short check could go there instead, and the run ends sooner.
    Control: with the window's deferral alone, C7 queued behind C9 (the measured 248 s start)."""
    durations = {"c10": 120.0, "c9a": 75.0, "c9b": 65.0, "c8": 50.0, "c7a": 35.0, "c7b": 30.0, "c5": 25.0}
    slow = set(durations)
    durations.update({f"q{i}": 1.0 for i in range(400)})
    makespan, sent, _ = _timed_run(durations, slow, {"c10"}, workers=4, old_rule=old_rule)
    behind = [(name, w, q) for name, w, q in sent if name in slow and q and q[0] in slow]
    if old_rule:
        assert behind, "control: the window alone queues a slow check behind a slow one"
        return
    assert not behind, f"slow checks queued behind slow ones: {behind}"
    old, _, _ = _timed_run(durations, slow, {"c10"}, workers=4, old_rule=True)
    assert makespan < old, f"the run took {makespan:.0f} s, {old:.0f} s without the next-slot rule"


@pytest.mark.parametrize("old_rule", [False, True], ids=["left-to-its-owner", "control-stolen"])
def test_a_worker_starting_a_slow_check_leaves_another_workers_key_to_it(old_rule):
    """The qwen3_moe shape on the H200 (2026-12-05): one worker owns C2's key with a backlog of its
    checks; another starts C9 when only those are left. It is shut down after C9 rather than queue
    one of them behind it (and start its own kernel workers for it, `key_start`). Control: stolen,
    the check waits the whole slow check and the run ends later."""
    durations = {"q0": 1.0, "s1": 60.0, **{f"k{i}": 3.0 for i in range(10)}}
    keys = {f"k{i}": "m:c2" for i in range(10)}
    makespan, sent, ends = _timed_run(durations, {"s1"}, set(), workers=2, old_rule=old_rule, keys=keys,
                                      key_start=20.0)
    ran = {name: w for name, w, _ in sent}
    assert sorted(ran) == sorted(durations), "every check ran exactly once"
    stolen = sorted(n for n in keys if ran[n] != ran["k0"])
    if old_rule:
        assert stolen, "control: without the rule a key check is stolen behind the slow one"
        return
    assert not stolen and ran["s1"] != ran["k0"], (ran, ends)
    old, _, _ = _timed_run(durations, {"s1"}, set(), workers=2, old_rule=True, keys=keys, key_start=20.0)
    assert makespan < old, f"the run took {makespan:.0f} s, {old:.0f} s when the check was stolen"


SHUTDOWN_SUITE = """
import os, time, pytest

def _note(name):
    with open(os.path.join({out!r}, name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main"))

@pytest.mark.C0
def test_a_quick():
    _note("quick")

@pytest.mark.C0
@pytest.mark.slow(seconds=2)
def test_b_slow():
    time.sleep(2.0)
    _note("slow")

@pytest.mark.C0
@pytest.mark.parametrize("i", range(6))
@pytest.mark.shared_setup("kernel workers")
def test_c_key(i):
    time.sleep(1.0 if i == 0 else 0.3)
    _note(f"key-{{i}}")
"""


def test_xdist_run_ends_a_worker_whose_slow_check_would_hold_another_workers_key(write_suite, tmp_path):
    """A real `-n 2` run (gate order kept: --maxfail): gw0 starts the slow check when only the other
    worker's key checks are left, and is shut down after it rather than take one; every check runs
    once and passes, and the run ends (xdist takes a worker shut down while checks are pending
    for another)."""
    pytest.importorskip("xdist")
    out = tmp_path / "ran"
    out.mkdir()
    pt = write_suite({"tests_c0_inventory/test_shutdown.py": SHUTDOWN_SUITE.format(out=str(out))})
    result = pt.runpytest_subprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                     "-n", "2", "--maxfail", "100", "tests_c0_inventory", timeout=120)
    result.assert_outcomes(passed=8)
    ran = {p.name: p.read_text() for p in out.iterdir()}
    keyed = {ran[f"key-{i}"] for i in range(6)}
    assert len(keyed) == 1 and ran["slow"] not in keyed and ran["quick"] == ran["slow"], ran
