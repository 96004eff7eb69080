"""Several xdist workers on one GPU (fixtures.runtime.gpu_memory, fixtures.vllm.pool): the budget's
arithmetic, engines' gpu_memory_utilization clipped to a worker's share, idle engines closed before
a start or a trainer that would not fit, leased ones parked when a start still runs out, and an
engine start that runs out of memory recorded as "not carried out: out of memory" with who held what. CPU
only: the engines are the fake worker backend, whose footprint is the KV cache it is asked for."""
from __future__ import annotations

import collections
import json
import os
import warnings

import pytest

from fixtures.core import environment
from fixtures.runtime import gpu_memory
from fixtures.core.contract import EngineSettings
from fixtures.vllm import client as vclient
from fixtures.vllm import implementation as vimpl
from fixtures.vllm import ipc as vipc
from fixtures.vllm import pool as vpool
from fixtures.vllm import settings as vset

pytest_plugins = ["pytester"]
GIB = 1 << 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake-model")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "eos_token_id": 7}))
    return d


@pytest.fixture(autouse=True)
def _logs(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path / "logs"))
    for name in ("CONFORMANCE_VLLM_GPU_MEMORY_BUDGET", gpu_memory.SHARERS_ENV, "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)


def _engine(model_dir, kv_bytes: int, fake: str = "echo", n: int = 1):
    """A fake engine whose measured footprint is `kv_bytes` (max_num_seqs makes each key distinct)."""
    settings = EngineSettings(max_num_seqs=n, extra={"kv_cache_memory_bytes": kv_bytes})
    return lambda: vclient.VLLMEngine(model_dir, settings, fake=fake)


# ---------------------------------------------------------------------------------------------
# the budget's arithmetic
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env, workers", [
    ({}, 1), ({"PYTEST_XDIST_WORKER_COUNT": "4"}, 4), ({"PYTEST_XDIST_WORKER_COUNT": "bad"}, 1),
    ({"PYTEST_XDIST_WORKER_COUNT": "8", gpu_memory.SHARERS_ENV: "2"}, 2)])
def test_workers_sharing_the_gpu(env, workers):
    assert gpu_memory.workers_sharing_gpu(env) == workers


def test_pinned_workers_share_a_gpu_round_robin():
    # gwN on GPU N mod G: 5 workers on 2 GPUs -> GPU 0 has gw0, gw2, gw4; GPU 1 has gw1, gw3
    assert [gpu_memory.sharers_when_pinned(i, 5, 2) for i in range(5)] == [3, 2, 3, 2, 3]
    assert [gpu_memory.sharers_when_pinned(i, 4, 8) for i in range(4)] == [1, 1, 1, 1]
    assert gpu_memory.sharers_when_pinned(0, 4, 0) == 4


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_each_worker_gets_its_share_of_the_budget(workers):
    b = gpu_memory.budget_from("0.8", env={"PYTEST_XDIST_WORKER_COUNT": str(workers)})
    assert b.fraction == 0.8 and b.workers == workers
    assert b.share == pytest.approx(0.8 / workers)
    assert b.share_bytes(141 * 10**9) == int(0.8 / workers * 141 * 10**9)
    assert b.share_bytes() is None                   # the device's size not known yet
    assert gpu_memory.budget_from(None, env={}).fraction == gpu_memory.DEFAULT_BUDGET


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1", "x", ""])
def test_budget_fraction_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="fraction"):
        gpu_memory.parse_fraction(bad)


def test_gpu_memory_utilization_is_clipped_to_the_share(model_dir):
    capped = vset.AdapterDefaults(gpu_memory_cap=0.05)
    eff = vset.effective_settings(EngineSettings(), capped)
    assert eff["gpu_memory_utilization"] == 0.05 and "gpu_memory_utilization_asked" not in eff
    eff = vset.effective_settings(EngineSettings(extra={"gpu_memory_utilization": 0.5}), capped)
    assert (eff["gpu_memory_utilization"], eff["gpu_memory_utilization_asked"]) == (0.05, 0.5)
    assert vset.effective_settings(EngineSettings(extra={"gpu_memory_utilization": 0.02}), capped)[
        "gpu_memory_utilization"] == 0.02
    assert vset.llm_kwargs(model_dir, EngineSettings(), capped)["gpu_memory_utilization"] == 0.05
    assert vset.effective_settings(EngineSettings())["gpu_memory_utilization"] == 0.1   # no budget: as before


@pytest.mark.parametrize("workers, utilization", [(1, 0.1), (4, 0.1), (16, 0.05)])
def test_the_implementation_sizes_engines_from_the_budget(model_dir, monkeypatch, workers, utilization):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    monkeypatch.setenv("CONFORMANCE_VLLM_GPU_MEMORY_BUDGET", "0.8")
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=0)
    try:
        assert impl.memory_budget.share == pytest.approx(0.8 / workers)
        assert f"/ {workers} worker" in impl.describe()["gpu_memory_budget"]
        with impl.make_engine(model_dir) as e:
            assert e.engine.kwargs["gpu_memory_utilization"] == pytest.approx(utilization)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with impl.make_engine(model_dir, EngineSettings(extra={"gpu_memory_utilization": 0.9})) as e:
                assert e.engine.kwargs["gpu_memory_utilization"] == pytest.approx(0.8 / workers)
                assert "clipped to" in e.engine.log_path.read_text()
        assert any("asked gpu_memory_utilization=0.9; clipped" in str(w.message) for w in seen)
    finally:
        impl.pool.close_all()


# ---------------------------------------------------------------------------------------------
# the pool keeps a worker's engines within its share
# ---------------------------------------------------------------------------------------------
def test_idle_engines_are_closed_before_a_start_that_would_not_fit(model_dir):
    # share 2 GiB; engines of 0.75 GiB; the idle cap (5) alone would keep them all
    pool = vpool.EnginePool(max_idle=5, budget=gpu_memory.MemoryBudget(0.5, 2, total_bytes=8 * GIB))
    try:
        a = pool.acquire("a", _engine(model_dir, 3 * GIB // 4, n=1))
        a_engine = a.engine
        assert vpool.engine_bytes(a_engine) == 3 * GIB // 4 and pool.largest == 3 * GIB // 4
        a.close()
        with pool.acquire("b", _engine(model_dir, 3 * GIB // 4, n=2)):
            pass
        assert len(pool.entries) == 2 and pool.held_bytes() == 3 * GIB // 2      # both idle, 1.5 GiB
        with pool.acquire("c", _engine(model_dir, 3 * GIB // 4, n=3)):
            assert list(pool.entries) == ["b", "c"], "the least recently used idle engine makes room"
            assert a_engine.proc.poll() is not None
        assert pool.closed_for_memory == 1 and pool.starts == 3
        report = pool.memory_report()
        assert [e["idle"] for e in report["held"]] == [True, True]
        assert report["budget"] == {"fraction": 0.5, "workers": 2, "share": 0.25, "share_bytes": 2 * GIB}
        # a trainer (or any big allocation) makes room through the registry, without knowing the pool
        freed = gpu_memory.make_room(GIB)
        assert freed == 3 * GIB // 4 and list(pool.entries) == ["c"]
        assert gpu_memory.make_room(None) == 3 * GIB // 4 and not pool.entries
    finally:
        pool.close_all()


def test_a_released_engine_beyond_the_share_is_not_kept(model_dir):
    pool = vpool.EnginePool(max_idle=2, budget=gpu_memory.MemoryBudget(0.25, 1, total_bytes=8 * GIB))
    try:
        with pool.acquire("big", _engine(model_dir, 3 * GIB)) as lease:
            proc = lease.engine.proc
        assert not pool.entries and proc.poll() is not None, "idle, it would hold 3 GiB of a 2 GiB share"
    finally:
        pool.close_all()


def test_without_a_budget_the_idle_cap_alone_decides(model_dir):
    pool = vpool.EnginePool(max_idle=2)
    try:
        for n in (1, 2):
            with pool.acquire(str(n), _engine(model_dir, 3 * GIB, n=n)):
                pass
        assert len(pool.entries) == 2 and pool.closed_for_memory == 0
    finally:
        pool.close_all()


# ---------------------------------------------------------------------------------------------
# an engine start out of memory: EngineOutOfMemory, after closing idle engines, parking leased ones
# ---------------------------------------------------------------------------------------------
def test_a_start_out_of_memory_closes_idle_then_parks_leased_engines_and_says_so(model_dir, monkeypatch):
    pool = vpool.EnginePool(max_idle=2)
    try:
        with pool.acquire("idle", _engine(model_dir, GIB, n=1)) as idle:
            idle_proc = idle.engine.proc
        here = environment.current_test()
        monkeypatch.setitem(environment._current, "nodeid", "tests_x.py::test_earlier")   # a lease of an earlier check
        kept = pool.acquire("kept", _engine(model_dir, GIB, n=2))
        monkeypatch.setitem(environment._current, "nodeid", here)
        kept_proc = kept._engine.proc
        with pytest.raises(vipc.EngineOutOfMemory) as info:
            pool.acquire("oom", _engine(model_dir, GIB, fake="oom_start", n=3))
        exc = info.value
        first = str(exc).splitlines()[0]
        assert first.startswith("vLLM worker: engine start raised ValueError: Free memory on device cuda:0")
        assert "1 idle engine of this worker closed first, 1 leased one parked; tried 3 times" in first
        assert exc.out_of_memory is True and isinstance(exc, vipc.VLLMWorkerError)
        assert idle_proc.poll() is not None and kept_proc.poll() is not None and not pool.entries
        assert kept.moved and kept.parked and pool.parked == 1
        # the same check does not try again (hypothesis re-runs a failing example while it shrinks)
        tried = []
        with pytest.raises(vipc.EngineOutOfMemory, match="not tried again: an earlier engine start of this check"):
            pool.acquire("oom", lambda: tried.append(1))
        assert not tried
        # the next check restarts the parked engine at its lease's first call, cold, and says why
        from fixtures.runtime import costs
        costs.drain()
        monkeypatch.setitem(environment._current, "nodeid", "tests_x.py::test_next")
        assert kept.engine.alive and kept.engine.proc is not kept_proc and not kept.parked
        (start,) = [c for c in costs.drain() if c["kind"] == "engine start"]
        assert list(pool.entries) == ["kept"] and pool.entries["kept"][1] == 1
        kept.close()
        assert pool.entries["kept"][1] == 0, "the restarted engine is the lease's: its close gives it back"
        monkeypatch.setitem(environment._current, "nodeid", None)    # outside a check (a benchmark script): always tried
        for _ in range(2):
            with pytest.raises(vipc.EngineOutOfMemory) as again:
                pool.acquire("oom", _engine(model_dir, GIB, fake="oom_start", n=3))
            assert "not tried again" not in str(again.value)
    finally:
        pool.close_all()


def test_two_workers_each_holding_a_session_engine_both_get_their_second(model_dir):
    """Measured on the H200 (-n 2, Qwen3-30B-A3B at full depth): each worker's session engine held
    65 GB, so a check's second engine fitted on neither side; both waited for the other until the
    run was cut, 0 of 36 checks done. Here the device fits one engine per worker: the start parks
    the leased session engine and succeeds; the session engine's next use restarts it after the
    second engine is given back; an engine with pushed weights stays. Negative control: with
    parking off the same start runs out."""
    pools = []

    def fits_one(pool, n):
        def make():
            live = [e for e, _ in pool.entries.values() if e.alive]
            return _engine(model_dir, GIB, fake="oom_start" if live else "echo", n=n)()
        return make
    try:
        for _ in range(2):                     # two workers' pools, each with its session engine leased
            pool = vpool.EnginePool(max_idle=2)
            pools.append(pool)
            session = pool.acquire("session", fits_one(pool, 1))
            with pool.acquire("chunked", fits_one(pool, 2)) as chunked:
                assert chunked.engine.alive and session.parked
            assert session.engine.alive and list(pool.entries) == ["session"]
            assert pool.parked == 1
        from fixtures.runtime import costs                # where workers share the GPU: one wait, then parking
        costs.drain()
        shared = vpool.EnginePool(max_idle=2, oom_waits=(0.01, 0.02))
        pools.append(shared)
        session = shared.acquire("session", fits_one(shared, 1))
        with shared.acquire("chunked", fits_one(shared, 2)):
            assert session.parked
        kinds = [c["kind"] for c in costs.drain()]
        assert kinds == ["engine start", "engine start waited for GPU memory",
                         "engine parked for another start's GPU memory", "engine start"], kinds
        pushed = vpool.EnginePool(max_idle=2)          # pushed weights cannot be restarted: never parked
        pools.append(pushed)
        trained = pushed.acquire("session", fits_one(pushed, 1))
        trained.engine.dirty = True
        with pytest.raises(vipc.EngineOutOfMemory, match="0 idle engines of this worker closed first; tried 1 time"):
            pushed.acquire("chunked", fits_one(pushed, 2))
        assert trained.engine.alive and not trained.parked
        control = vpool.EnginePool(max_idle=2)
        pools.append(control)
        control._park_leased = lambda need, **kw: 0
        control.acquire("session", fits_one(control, 1))
        with pytest.raises(vipc.EngineOutOfMemory, match="0 idle engines of this worker closed first; tried 1 time"):
            control.acquire("chunked", fits_one(control, 2))
    finally:
        for pool in pools:
            pool.close_all()


class _Neighbour:
    """gpu_memory.RoomBroker stand-in: one other worker (its own pool) that gives up its engines
    at the `gives_up_at`-th look (None: never)."""

    def __init__(self, pool, gives_up_at: int | None = 2):
        self.pool, self.gives_up_at, self.looks, self.held = pool, gives_up_at, 0, False

    def hold(self) -> bool:
        self.held = True
        return True

    def pending(self) -> list[str]:
        self.looks += 1
        if self.gives_up_at is not None and self.looks >= self.gives_up_at and self.pool.entries:
            self.pool.release_for_neighbour()
        return ["gw1"] if self.pool.entries else []


def _shared_device(tmp_path, monkeypatch, engines: int) -> None:
    """A fake device the fake engines of every pool share (fixtures.vllm.fake_backend): `engines`
    footprints of 1 GiB fit."""
    d = tmp_path / "device"
    d.mkdir()
    monkeypatch.setenv("CONFORMANCE_FAKE_DEVICE", f"{d}:{engines * GIB}")


@pytest.mark.parametrize("broker", [True, False], ids=["room asked for", "control: no broker"])
def test_a_check_needing_two_engines_gets_the_other_workers_memory(model_dir, tmp_path, monkeypatch, broker):
    """Measured on the H200 (-n 2, Qwen3-30B-A3B at full depth): a check needing its session engine
    and one of its own fitted only while the other worker held nothing; parking its own engines was
    not enough, and 2 of 36 checks ran out after 60 s of waits. Here a device fits two engines,
    each worker holds a session engine, and this worker's check needs two at once: it parks its own
    session engine, then (for that engine's restart) holds the device while the other worker gives
    up its engine, and both of its engines are live together. Negative control: with no broker the
    last resort parks the check's own second engine, which then restarts at every call."""
    from fixtures.runtime import costs
    _shared_device(tmp_path, monkeypatch, engines=2)
    here = "tests_x.py::test_two_engines"
    pools = [vpool.EnginePool(max_idle=0, oom_waits=(0.01,)) for _ in range(2)]
    mine, theirs = pools
    neighbour = _Neighbour(theirs)
    monkeypatch.setattr(gpu_memory, "_broker", [neighbour if broker else None])
    try:
        monkeypatch.setitem(environment._current, "nodeid", "tests_x.py::test_earlier")
        their_session = theirs.acquire("session", _engine(model_dir, GIB, n=1))
        my_session = mine.acquire("session", _engine(model_dir, GIB, n=1))
        monkeypatch.setitem(environment._current, "nodeid", here)
        costs.drain()
        with mine.acquire("second", _engine(model_dir, GIB, n=2)) as second:
            assert my_session.parked, "this worker's own session engine is parked first"
            for _ in range(2):                       # the check uses both, in turn
                first_engine, second_engine = my_session.engine, second.engine
            kinds = [c["kind"] for c in costs.drain()]
            if broker:
                assert first_engine.alive and second_engine.alive and not second.moved
                assert their_session.parked and neighbour.held
                assert kinds == ["engine start waited for GPU memory", "engine parked for another start's GPU memory",
                                 "engine start",                    # the second engine; then the session's restart,
                                 # with no second wait for peaks (the check's first showed they do not pass):
                                 "engine parked for another start's GPU memory",     # the other worker's (one process here)
                                 "engine start waited for the other workers to give up their engines",
                                 "engine start"], kinds
            else:
                assert not their_session.parked
                assert kinds.count("engine start") == 5, kinds       # the two engines swap at every call
                assert second.parked or my_session.parked
        assert their_session.engine.alive, "the other worker's parked session engine restarts at its next call"
    finally:
        for pool in pools:
            pool.close_all()


def test_a_start_the_other_workers_do_not_make_room_for_ends_saying_who_held_theirs(model_dir, tmp_path,
                                                                                     monkeypatch):
    _shared_device(tmp_path, monkeypatch, engines=1)
    theirs, mine = vpool.EnginePool(max_idle=0), vpool.EnginePool(max_idle=0, oom_waits=(0.01,))
    monkeypatch.setattr(gpu_memory, "_broker", [_Neighbour(theirs, gives_up_at=None)])
    monkeypatch.setattr(mine, "ROOM_WAIT_S", 0.3)
    try:
        held = theirs.acquire("session", _engine(model_dir, GIB, n=1))
        with pytest.raises(vipc.EngineOutOfMemory, match=r"after the device was held \d+ s for the other workers to "
                                                         r"give up their engines \(gw1 still held theirs\)"):
            mine.acquire("mine", _engine(model_dir, GIB, n=2))
        assert held.engine.alive and not held.parked
    finally:
        theirs.close_all()
        mine.close_all()


def test_a_start_out_of_memory_waits_for_other_workers_memory(model_dir):
    """Measured on the H200 (-n 4, one GPU): a compiled engine's start ran out of memory held by
    the other workers' transient peaks. With nothing of its own left to close, the pool waits and
    tries again (oom_waits; VLLMImplementation sets 10, 20, 30 s where workers share the GPU), and
    says so in the check's costs; when every wait is spent the error says how long it waited."""
    from fixtures.runtime import costs
    costs.drain()
    attempts = []

    def flaky():
        attempts.append(1)
        return _engine(model_dir, GIB, fake="oom_start" if len(attempts) < 3 else "echo", n=4)()
    pool = vpool.EnginePool(max_idle=2, oom_waits=(0.01, 0.02))
    try:
        with pool.acquire("late", flaky) as e:
            assert e.engine.alive and len(attempts) == 3
        assert [c["kind"] for c in costs.drain()] == ["engine start waited for GPU memory"] * 2 + ["engine start"]
        with pytest.raises(vipc.EngineOutOfMemory, match=r"1 idle engine of this worker closed first; tried 4 times, waiting 0 s for other workers' memory"):
            pool.acquire("never", _engine(model_dir, GIB, fake="oom_start", n=5))
    finally:
        pool.close_all()


def test_an_engine_error_that_is_not_memory_stays_a_worker_error(model_dir):
    pool = vpool.EnginePool(max_idle=2)
    try:
        with pytest.raises(vipc.VLLMWorkerError) as info:
            pool.acquire("x", _engine(model_dir, GIB, fake="fail_start"))
        assert not isinstance(info.value, vipc.EngineOutOfMemory)
    finally:
        pool.close_all()


OOM_SUITE = """
import json, pytest
from fixtures.runtime import gpu_memory
from fixtures.core.contract import EngineSettings
from fixtures.vllm import client, pool as vpool

@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000}))
    return tmp_path

@pytest.mark.C0
def test_c0_ok(): pass

@pytest.mark.C3
def test_engine_start_out_of_memory(model_dir):
    pool = vpool.EnginePool(max_idle=2, budget=gpu_memory.MemoryBudget(0.85, 4, total_bytes=140 << 30))
    make = lambda fake, n: lambda: client.VLLMEngine(model_dir, EngineSettings(max_num_seqs=n,
        extra={"kv_cache_memory_bytes": 6 << 30}), fake=fake)
    pool._park_leased = lambda need, **kw: 0                # parking off: a leased engine still live at the OOM
    held = pool.acquire("held", make("echo", 1))
    try:
        pool.acquire("oom", make("oom_start", 2))
    finally:
        pass

@pytest.mark.C3
def test_plain_engine_failure(model_dir):
    client.VLLMEngine(model_dir, fake="fail_start")
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_an_engine_start_out_of_memory_is_an_oom_outcome_with_who_held_what(write_suite, xdist):
    if xdist:
        pytest.importorskip("xdist")
    pt = write_suite({"tests_c0_inventory/test_engine_oom.py": OOM_SUITE})
    res = pt.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                 "--report=rep", *(["-n", "2"] if xdist else []))
    res.assert_outcomes(passed=1, failed=2)
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    checks = {c["nodeid"].rpartition("::")[2]: c for c in doc["checks"]}
    oom = checks["test_engine_start_out_of_memory"]
    assert oom["outcome"] == "not carried out: out of memory", oom
    assert oom["reason"].startswith("EngineOutOfMemory: vLLM worker: engine start raised ValueError: Free memory on "
                                    "device cuda:0 (10.50/139.80 GiB) on startup is less than desired GPU memory")
    (holder,) = oom["memory"]["holders"]
    (engine,) = holder["held"]
    assert engine["bytes"] == 6 << 30 and engine["idle"] is False and "vLLM engine" in engine["what"]
    assert holder["budget"]["workers"] == 4 and holder["budget"]["share_bytes"] == int(0.85 / 4 * (140 << 30))
    assert "this worker's vLLM engines: vLLM engine " in oom["reason"] and "6.00 GiB" in oom["reason"]
    assert "budget 0.85 of the device / 4 workers = 29.75 GiB each" in oom["reason"]
    assert checks["test_plain_engine_failure"]["outcome"] == "failed"
    c3 = doc["gates"]["C3"]["models"]["llama"]
    assert c3["errors"] == {oom["nodeid"]: "not carried out: out of memory"}
    assert c3["status"] == "fail"     # the plain failure still fails the gate; the OOM alone would not
    md = (pt.path / "rep" / "report.md").read_text()
    assert "**NOT CARRIED OUT: OUT OF MEMORY**" in md and "this worker's vLLM engines" in md


def test_breakdown_marks_this_workers_processes(monkeypatch):
    """nvidia-smi's compute processes, this worker's (its pid, its engines' pids) marked; summary
    names the others (faked: no GPU here)."""
    class Holder:
        def memory_report(self):
            return {"holder": "h", "held": [{"what": "engine", "bytes": 2 * GIB, "pid": 4242, "idle": True}],
                    "budget": None}

        def release_idle(self, need):
            return 0
    h = Holder()
    gpu_memory.register(h)
    monkeypatch.setattr(gpu_memory, "compute_apps", lambda: [
        {"pid": os.getpid(), "name": "python", "bytes": GIB, "gpu": "u"},
        {"pid": 4242, "name": "python", "bytes": 2 * GIB, "gpu": "u"},
        {"pid": 999999, "name": "other", "bytes": 30 * GIB, "gpu": "u"}])
    mem = gpu_memory.breakdown(RuntimeError("CUDA out of memory"))
    assert [a["mine"] for a in mem["gpu_processes"]] == [True, True, False]
    text = gpu_memory.summary(mem)
    assert "h: engine 2.00 GiB idle (together 2.00 GiB)" in text
    assert "GPU processes: this worker's 3.00 GiB; others pid 999999 30.00 GiB" in text
    del h


@pytest.mark.parametrize("numprocesses, pinned, want", [(4, False, 4), (None, False, 1), (0, False, 1), (4, True, 1)])
def test_the_controller_counts_its_workers_as_gpu_sharers(monkeypatch, numprocesses, pinned, want):
    """The header comes from the xdist controller, which is no worker: under -n 4 its memory
    budget must say 4 workers share the GPU (an H200 run's said 1); pinned, each worker counts."""
    from types import SimpleNamespace
    from fixtures.plugin import session
    config = SimpleNamespace(option=SimpleNamespace(numprocesses=numprocesses),
                             getoption=lambda name: pinned if name == "--gpu-per-worker" else None)
    session._count_gpu_sharers(config)
    assert gpu_memory.workers_sharing_gpu() == want
    assert gpu_memory.budget_from("0.8").workers == want


def test_pinned_workers_export_how_many_share_their_gpu(monkeypatch):
    from fixtures.plugin import session
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for worker, gpu, sharers in (("gw0", "5", "2"), ("gw1", "7", "1"), ("gw2", "5", "2")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
        session._pin_gpu(worker)
        assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ[gpu_memory.SHARERS_ENV]) == (gpu, sharers)
        assert gpu_memory.workers_sharing_gpu() == int(sharers)


def test_a_trainer_makes_room_first_and_retries_once_after_an_oom(model_dir, monkeypatch):
    import torch
    (model_dir / "model.safetensors").write_bytes(b"\0" * 1000)
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=2)
    rooms, builds = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_memory, "make_room", lambda need=None: rooms.append(need) or 0)

    def build(path):
        builds.append(path)
        if len(builds) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "trainer"
    monkeypatch.setattr(impl, "_build_trainer", build)
    try:
        assert impl.make_trainer(model_dir) == "trainer"
        assert rooms == [2000, None] and len(builds) == 2, "room for weights + gradients, then everything idle"
    finally:
        impl.pool.close_all()
        (model_dir / "model.safetensors").unlink()


FAULT_SUITE = """
import pytest
from fixtures.runtime import gpu_memory

@pytest.mark.C7
def test_launches_the_faulting_kernel(monkeypatch):
    # the fault surfaces at the next CUDA call: here, the plugin's wait after the check
    gpu_memory.sticky_cuda_error = lambda: "AcceleratorError: CUDA error: an illegal memory access was encountered"

@pytest.mark.C7
def test_next_check():
    pass
"""


def test_a_cuda_fault_is_pinned_on_the_check_that_launched_it(write_suite):
    """A kernel fault is reported when CUDA is next called, and poisons the context: the plugin waits
    for each check's CUDA work, so the fault is that check's teardown error, and the checks after it
    in the process are "not run" naming it - not failures of their own (measured on the H200: 15
    checks failed with the error of one)."""
    pt = write_suite({"tests_c8_training/test_fault.py": FAULT_SUITE})
    res = pt.runpytest_subprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                  "--report=rep")       # a subprocess: the check replaces a module function
    out = res.stdout.str()
    assert "ERROR at teardown of test_launches_the_faulting_kernel" in out, out
    assert "an illegal memory access was encountered - raised by CUDA work this check" in out, out
    assert "not run: this process's CUDA context is unusable since " \
           "tests_c8_training/test_fault.py::test_launches_the_faulting_kernel" in out, out


PEAK_SUITE = """
import pytest

@pytest.mark.C0
def test_small(): pass

@pytest.mark.C0
def test_big(): pass
"""


def test_each_checks_own_gpu_peak_reaches_the_report(write_suite, monkeypatch):
    """Measured on the H200: a qwen3 `-n 4` run peaked at 137 GB against its 122 GB budget and the
    report could not say which check's own allocations did it. Each check's end records this
    process's torch peak and the device's used memory (faked here: no CUDA), largest first in the
    report's time section; without CUDA nothing is recorded."""
    peaks = [(1, 40), (18, 137)]             # in collection order: test_small, test_big

    def fake_peak():
        own, used = peaks.pop(0)
        return {"own_peak_bytes": own * GIB, "device_used_bytes": used * GIB}
    monkeypatch.setattr(gpu_memory, "check_peak", fake_peak)
    pt = write_suite({"tests_c0_inventory/test_peaks.py": PEAK_SUITE})
    res = pt.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                 "--report=rep", "-m", "C0")
    res.assert_outcomes(passed=2)
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    got = {c["nodeid"].rpartition("::")[2]: c["gpu"] for c in doc["checks"]}
    assert got == {"test_small": {"own_peak_bytes": GIB, "device_used_bytes": 40 * GIB},
                   "test_big": {"own_peak_bytes": 18 * GIB, "device_used_bytes": 137 * GIB}}
    md = (pt.path / "rep" / "report.md").read_text()
    assert ("largest peaks of a check's own pytest process (torch reserved; engines are other processes): "
            "`tests_c0_inventory/test_peaks.py::test_big` 18.0 GiB, `tests_c0_inventory/test_peaks.py::test_small` "
            "1.0 GiB") in md
    assert "the device's most used at a check's end (all processes): 137.0 GiB, after " \
           "`tests_c0_inventory/test_peaks.py::test_big`" in md
    monkeypatch.undo()
    assert gpu_memory.check_peak() == {}, "this CPU process never initialised CUDA: nothing to record"


ROOM_SUITE = """
import json, pytest
from fixtures.runtime import gpu_memory
from fixtures.core.contract import EngineSettings
from fixtures.vllm import client, pool as vpool

GIB = 1 << 30
POOL = vpool.EnginePool(max_idle=0, oom_waits=(0.05,))     # a worker's pool, as VLLMImplementation makes it

def make(model_dir, n):
    return lambda: client.VLLMEngine(model_dir, EngineSettings(max_num_seqs=n,
                                                               extra={{"kv_cache_memory_bytes": GIB}}), fake="echo")

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({{"model_type": "qwen3", "vocab_size": 1000}}))
    return d

@pytest.fixture(scope="session")
def session_engine(model_dir):
    import glob, os, time
    lease = POOL.acquire("session", make(model_dir, 1))
    device = os.environ["CONFORMANCE_FAKE_DEVICE"].rpartition(":")[0]
    t0 = time.monotonic()                  # both workers hold their session engine: the device is full
    while len(glob.glob(os.path.join(device, "engine-*"))) < 2 and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    yield lease
    lease.close()

if {control}:
    @pytest.fixture(autouse=True)
    def _no_broker():
        gpu_memory.set_room_broker(None)

@pytest.mark.C3
@pytest.mark.parametrize("i", range(4))
def test_two_engines_at_once(session_engine, model_dir, i):
    import time
    with POOL.acquire(f"check-{{i}}", make(model_dir, 2 + i)) as second:
        for _ in range(3):                 # the check uses both, in turn, while the other worker's check runs
            first, other = session_engine.engine, second.engine
            assert first.alive and other.alive
            assert not session_engine.moved and not second.moved, "the check's engines swap: one parked for the other"
            time.sleep(0.3)
"""


@pytest.mark.parametrize("control", [False, True], ids=["room asked for", "control: no broker"])
def test_two_xdist_workers_on_a_device_of_two_engines_each_get_both_engines_of_their_checks(
        write_suite, tmp_path, monkeypatch, control):
    """The H200 case (-n 2, a 30B model: two engines fill the GPU) in real xdist workers sharing a
    fake device that fits two engines: each worker holds its session engine, and every check needs
    it and one engine of its own at once. The worker whose start runs out holds the device
    (fixtures.runtime.exclusive.DeviceRoom), the other gives up its engines at its next check
    boundary, and every check passes with both engines live. Negative control: without the
    broker the checks fail (their engines swap, or a start runs out)."""
    pytest.importorskip("xdist")
    device = tmp_path / "device"
    device.mkdir()
    monkeypatch.setenv("CONFORMANCE_FAKE_DEVICE", f"{device}:{2 * GIB}")
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path / "logs"))
    pt = write_suite({"tests_c5_invariance/test_room.py": ROOM_SUITE.format(control=control)})
    res = pt.runpytest_subprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                  "-n", "2", "--report=rep", "tests_c5_invariance", timeout=300)
    doc = json.loads((pt.path / "rep" / "report.json").read_text())
    outcomes = {c["nodeid"].rpartition("::")[2]: c["outcome"] for c in doc["checks"]}
    if control:
        assert any(o != "passed" for o in outcomes.values()), outcomes
        return
    assert set(outcomes.values()) == {"passed"}, (outcomes, res.stdout.str()[-3000:])
    kinds = collections.Counter(kind for c in doc["checks"] for kind in (c.get("costs") or {}))
    assert kinds["engine start waited for the other workers to give up their engines"] >= 1, kinds
    assert kinds["gave up its GPU memory for another worker's engine start"] >= 1, kinds
