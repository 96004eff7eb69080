"""Gate C10 - Delivery: rollout throughput with invariance on vs off on the same workload and
engine (after warm-up, CUDA graphs where the engine has them), reported as a ratio with a
configurable minimum (--min-throughput-ratio; none by default: then the check is that the
measurement is sound). C10 passes only when C0-C9 passed in the same run - the verdict rule
blocks it otherwise - and the run's report carries the table, environment, inventory, parity
metrics and this ratio."""
from __future__ import annotations

import time

import pytest

from fixtures.core.contract import EngineSettings
from fixtures.checks.workloads import rollout_requests

pytestmark = pytest.mark.C10

MIN_TOKENS = 200      # generated tokens per timed run: below this the ratio is noise


def _timed(engine, requests, repeats: int = 2) -> tuple[float, int]:
    engine.generate(requests[:2])                      # warm-up: kernels, caches, allocator
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(requests)
        best = min(best, time.perf_counter() - t0)
        tokens = sum(len(s.token_ids) for c in out for s in c.samples)
    return best, tokens


def test_throughput_ratio(engine_factory, proxy, pytestconfig, record_metric):
    reqs = rollout_requests(proxy.config.vocab_size, 8, seed=3, n=4)
    graphs = None
    with engine_factory(EngineSettings(batch_invariant=True)) as on:
        if on.capabilities().cuda_graphs:
            graphs = True
    settings = dict(cuda_graphs=graphs) if graphs else {}
    with engine_factory(EngineSettings(batch_invariant=True, **settings)) as on:
        t_on, tok_on = _timed(on, reqs)
    with engine_factory(EngineSettings(batch_invariant=False, **settings)) as off:
        t_off, tok_off = _timed(off, reqs)
    assert tok_on == tok_off, f"invariance on/off generated different token counts ({tok_on} vs {tok_off}): not the same workload"
    assert tok_on >= MIN_TOKENS, f"only {tok_on} tokens per timed run; need >= {MIN_TOKENS} for a stable ratio"
    ratio = (tok_on / t_on) / (tok_off / t_off)
    record_metric("throughput_on_tok_s", round(tok_on / t_on, 1))
    record_metric("throughput_off_tok_s", round(tok_off / t_off, 1))
    record_metric("throughput_ratio", round(ratio, 3))
    minimum = pytestconfig.getoption("--min-throughput-ratio")
    if minimum is not None:
        assert ratio >= minimum, f"throughput ratio {ratio:.3f} (on {tok_on / t_on:.0f} tok/s, off " \
                                 f"{tok_off / t_off:.0f} tok/s) below --min-throughput-ratio {minimum}"


def test_report_destination_is_writable(pytestconfig, artifact_dir):
    """The report is the deliverable: its directory must take files before the run ends."""
    probe = artifact_dir / ".write-probe"
    probe.write_text("ok")
    assert probe.read_text() == "ok"
    probe.unlink()
