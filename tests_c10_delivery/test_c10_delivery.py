"""Gate C10 - Delivery: rollout throughput with invariance on vs off on the same rollout-sized
workload (fixtures.checks.workloads.RolloutWorkload: --rollout-workload, taken as given, else the
default of the implementation's device - 256 prompts x 256 in x 128 out x 4 samples on an
accelerator, a few seconds' worth on the CPU - with its prompts cut to what both engines' KV caches
hold at once where they report it, ReportsKVCache), after a warm-up, in ROUNDS rounds alternating
stock / invariance on (the ratio is the rounds' median, reported with its min / max and each side's
preemptions), with CUDA graphs on where the engine has them, timed
by the engine's own clock where it has one (fixtures.checks.throughput), with no other xdist worker
running a check meanwhile (fixtures.runtime.exclusive). The ratio and what was
measured go into the report's metrics; --min-throughput-ratio R makes the ratio a threshold (none
by default: then the check is that the measurement is sound). C10 passes only when C0-C9 passed
in the same run - the verdict rule blocks it otherwise - and the run's report carries the table,
environment, inventory, parity metrics and this ratio."""
from __future__ import annotations

import pytest

from fixtures.checks.throughput import (check_ratio, fit_to_kv_cache, parse_min_throughput_ratio, throughput_metrics,
                                        time_rounds, warm_up)
from fixtures.checks.workloads import rollout_workload
from fixtures.core.contract import EngineSettings, ReportsKVCache
from fixtures.runtime.exclusive import alone

pytestmark = pytest.mark.C10


@pytest.mark.slow(seconds=230)
@pytest.mark.device_alone                         # the other workers run short checks until it has timed
@pytest.mark.engine_config("cuda_graphs=on")     # C5's CUDA-graph engine is C10's invariance-on engine
def test_throughput_ratio(engine_factory, proxy, impl, pytestconfig, record_metric):
    """Both engines started first; then the device's lock taken, both warm-ups run while the other
    workers' running checks end, and, with the device to this check alone (no other xdist worker
    runs a check meanwhile: fixtures.runtime.exclusive), each side's timed runs."""
    asked = pytestconfig.getoption("--rollout-workload")
    workload = rollout_workload(asked, impl.device())
    minimum = parse_min_throughput_ratio(pytestconfig.getoption("--min-throughput-ratio"))
    vocab = proxy.config.vocab_size
    with engine_factory(EngineSettings(batch_invariant=True)) as probe:
        graphs = bool(probe.capabilities().cuda_graphs)
    extra = {"cuda_graphs": True} if graphs else {}
    with engine_factory(EngineSettings(batch_invariant=True, **extra)) as on_engine, \
            engine_factory(EngineSettings(batch_invariant=False, **extra)) as off_engine:
        sides = ((True, on_engine), (False, off_engine))
        if asked:
            fitted = "as given (--rollout-workload): not fitted to the KV cache"
        else:
            workload, fitted = fit_to_kv_cache(workload, [e.kv_cache_capacity() for _, e in sides
                                                          if isinstance(e, ReportsKVCache)])

        def warm_both():
            for invariant, engine in sides:
                warm_up(engine, workload, vocab, batch_invariant=invariant)
        with alone(pytestconfig, meanwhile=warm_both) as device:
            rounds = time_rounds(on_engine, off_engine, workload, vocab, cuda_graphs=graphs)
    on, off = rounds.best(True), rounds.best(False)
    for name, value in throughput_metrics(workload, on, off, rounds, fitted).items():
        record_metric(name, value)
    record_metric("throughput_device", device.describe())
    print(f"C10 workload {workload.describe()} ({fitted}); CUDA graphs {'on' if graphs else 'off'}; invariance on "
          f"{on.describe()}; off {off.describe()}; {rounds.describe()}; {device.describe()}")
    assert minimum is None or device.alone, (
        f"--min-throughput-ratio {minimum:g} cannot be judged: the timing was not alone on the device "
        f"({device.describe()}); ratio {rounds.spread()[1]:.3f} as measured ({rounds.describe()})")
    check_ratio(on, off, minimum, workload, rounds)


def test_report_destination_is_writable(pytestconfig, artifact_dir):
    """The report is the deliverable: its directory must take files before the run ends."""
    probe = artifact_dir / ".write-probe"
    probe.write_text("ok")
    assert probe.read_text() == "ok"
    probe.unlink()
