"""C9's negative controls can fail: against an engine whose weight hashes always mirror the trainer's
and whose weight push does nothing (planted), `test_skipped_and_lossy_pushes_are_detected` must say
which controls did not fire; on the reference stack as it is, it passes. The reference stack on the
CPU, a tiny llama proxy: a few seconds."""
from __future__ import annotations

import pytest

from fixtures.checks.workloads import parity_workload
from fixtures.runtime.costs import Phases
from fixtures.models.proxies import build_proxy
from tests_c10_delivery import test_c9_rl as C9


class _BlindHashes:
    """The engine, but its weight hashes are the trainer's, whatever it holds (and a push is dropped)."""

    def __init__(self, engine, trainer):
        self._engine, self._trainer = engine, trainer

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def weight_hashes(self):
        return self._trainer.weight_hashes()

    def load_weights(self, named_tensors) -> None:
        pass


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    return build_proxy("llama", "tiny", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("planted", [True, False], ids=["blind-hashes", "control-as-is"])
def test_the_push_controls_fire_or_say_which_did_not(proxy, planted):
    from fixtures.reference.implementation import ReferenceImplementation
    impl = ReferenceImplementation()
    trainer = impl.make_trainer(proxy.path)
    engine = impl.make_engine(proxy.path)
    try:
        workload = parity_workload(impl.device())
        pair = (_BlindHashes(engine, trainer) if planted else engine, trainer)
        check = C9.test_skipped_and_lossy_pushes_are_detected
        if planted:
            with pytest.raises(AssertionError) as info:
                check(pair, proxy, (workload, None), Phases("C9 phases"))
            text = str(info.value)
            assert "skipped push not detected by the per-tensor hashes" in text
            assert "a lossy round trip of the weights went unnoticed by the hashes" in text
            assert "parity of the second rollout" not in text, "the stale engine's parity still fails"
        else:
            check(pair, proxy, (workload, None), Phases("C9 phases"))
    finally:
        engine.close()
        trainer.close()


def test_both_sides_hash_at_once_and_each_says_its_own(fake_vllm_impl, fake_model_dir):
    """C9's both_hashes: the engine's hashes asked from a thread while the trainer hashes (each side
    takes as long as the other here, so one after the other would take twice as long), and the
    engine's from a worker process through the pipe are what a plain call returns."""
    import time

    class Slow:
        def __init__(self, hashes):
            self.hashes = hashes

        def weight_hashes(self):
            time.sleep(0.6)
            return self.hashes
    t0 = time.perf_counter()
    assert C9.both_hashes(Slow({"a": "1"}), Slow({"a": "2"})) == ({"a": "1"}, {"a": "2"})
    assert time.perf_counter() - t0 < 1.0, "the two sides hashed one after the other"
    with fake_vllm_impl.make_engine(fake_model_dir) as engine:
        theirs, mine = C9.both_hashes(engine, Slow({"w": "x"}))
        assert theirs == engine.weight_hashes() and mine == {"w": "x"}
