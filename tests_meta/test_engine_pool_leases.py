"""The engine pool's leases are independent: a weight push through one never reaches another.

Why: two open leases of one configuration share one live engine (the session `engine` fixture and
a check's `engine_factory()` or C9's `fresh_pair`). On the H200 (2026-12-02, qwen3_moe `-n 4`) a C9
push reached the session engine that way, and later C7 checks in that worker compared a trained
model with the checkpoint's (1-ULP differences in 9 % of the embedding's elements). Fake workers
(fixtures.vllm.fake_backend): no GPU, no vLLM."""
from __future__ import annotations

import torch

from fixtures.reference.hf_trainer import tensor_sha256


PUSHED = {"model.embed_tokens.weight": torch.randn(10, 4, generator=torch.Generator().manual_seed(0)).bfloat16()}


def push_beside_a_session_lease(fake_vllm_impl, fake_model_dir):
    """The C9 pattern: a session lease open, a second lease of the same configuration pushes
    weights and is closed. Returns (session lease, the pushed engine's worker, the session
    engine's worker before the push)."""
    session = fake_vllm_impl.make_engine(fake_model_dir)
    before = session.engine.proc
    with fake_vllm_impl.make_engine(fake_model_dir) as pusher:
        assert pusher.engine.proc is before, "one configuration, one live engine: the leases share it"
        pusher.load_weights(PUSHED)
        assert pusher.weight_hashes() == {k: tensor_sha256(v) for k, v in PUSHED.items()}
        pushed = pusher.engine.proc
    return session, pushed, before


def test_a_push_moves_the_other_leases_to_an_engine_of_their_own(fake_vllm_impl, fake_model_dir):
    session, pushed, before = push_beside_a_session_lease(fake_vllm_impl, fake_model_dir)
    assert session.weight_hashes() == {}, "the session lease must keep the checkpoint's weights, not the push"
    assert session.engine.proc is not before and fake_vllm_impl.pool.moves == 1
    assert pushed.poll() is not None, "the pushed engine, dirty and unleased, is closed"
    with fake_vllm_impl.make_engine(fake_model_dir) as third:          # the moved lease's new engine is a clean one to share
        assert third.engine.proc is session.engine.proc and third.weight_hashes() == {}
    session.close()
    assert fake_vllm_impl.pool.open_leases == []


def test_the_pushing_lease_keeps_its_engine(fake_vllm_impl, fake_model_dir):
    """The pusher is never moved (C9 checks the prefix cache as the push left it, so the pusher
    must stay on the engine it pushed into)."""
    session = fake_vllm_impl.make_engine(fake_model_dir)
    pusher = fake_vllm_impl.make_engine(fake_model_dir)
    proc = pusher.engine.proc
    pusher.load_weights(PUSHED)
    assert session.engine.proc is not proc           # the other lease moved at its next call
    pusher.load_weights(PUSHED)                      # a second push moves nobody: no one shares it now
    assert pusher.engine.proc is proc and fake_vllm_impl.pool.moves == 1
    pusher.close()
    session.close()
    assert proc.poll() is not None


def test_control_without_the_move_the_push_leaks(fake_vllm_impl, fake_model_dir, monkeypatch):
    """Negative control: with the pool's claim planted away, the session lease serves the pushed
    weights - what the check above must see fail."""
    monkeypatch.setattr(fake_vllm_impl.pool, "claim", lambda lease: None)
    session, _, before = push_beside_a_session_lease(fake_vllm_impl, fake_model_dir)
    assert session.engine.proc is before
    assert session.weight_hashes() == {k: tensor_sha256(v) for k, v in PUSHED.items()}
    session.close()


def test_weight_hashes_in_threads_are_the_per_tensor_hashes_in_order():
    """tensor_sha256s (C9's weight hashes, a few tensors at a time in threads) gives each tensor's
    tensor_sha256 under its name, in the input's order, from a mapping or from pairs; control: one
    element changed by one ULP changes that tensor's digest and no other."""
    import torch
    from fixtures.reference.hf_trainer import tensor_sha256s
    g = torch.Generator().manual_seed(5)
    weights = {f"w{i}": torch.randn(17 + i, 3, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
               for i in range(11)}
    weights["empty"] = torch.zeros(0)
    want = {k: tensor_sha256(v) for k, v in weights.items()}
    got = tensor_sha256s(weights)
    assert got == want and list(got) == list(weights)
    assert tensor_sha256s(iter(weights.items())) == want
    changed = dict(weights)
    changed["w4"] = weights["w4"].clone()
    changed["w4"][3, 1] = torch.nextafter(changed["w4"][3, 1], torch.tensor(float("inf")))
    other = tensor_sha256s(changed)
    assert [k for k in want if other[k] != want[k]] == ["w4"]
