"""Meta tests of fixtures/reference/selective_replay.py: the exact-replay Mamba-1 mixer (MambaMixer,
FalconMambaMixer) the reference engine and trainer share. Bitwise only between its own paths
(prefill, decode, splits, packing); against transformers' torch path with a tolerance."""
from __future__ import annotations

import pytest
import torch

from fixtures.core.comparison import assert_bitwise
from fixtures.models.proxies import FAMILIES_DIR, build_proxy, load_model
from fixtures.reference import mamba_replay as R
from fixtures.reference import selective_replay as S
from fixtures.reference.invariant_mode import batch_invariant_mode

MODELS = ("mamba", "falcon_mamba")     # falcon_mamba: weightless RMSNorms on dt, B and C


@pytest.fixture(scope="module")
def mixers(tmp_path_factory):
    """family -> the first Mamba-1 mixer of its tiny proxy (conv_kernel 4, state 16)."""
    root = tmp_path_factory.mktemp("selective")
    out = {}
    for name in MODELS:
        model = load_model(build_proxy(FAMILIES_DIR / name, "tiny", root / name).path)
        out[name] = next(m for m in model.modules() if S.is_selective_mixer(m))
        assert not R.is_mamba_mixer(out[name]) and R.is_state_mixer(out[name])
    return out


def _hidden(mixer, length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, mixer.hidden_size, generator=g)


def _run(mixer, x: torch.Tensor, cuts) -> torch.Tensor:
    """The replay over x [T, hidden] fed in pieces ending at `cuts`, state carried between them."""
    state, outs, start = None, [], 0
    for end in cuts:
        (o,), (state,), _ = R.mixer_step(mixer, [x[start:end]], [state])
        outs.append(o)
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("name", MODELS)
def test_same_model_as_transformers(mixers, name):
    """A prefill of two sequences: transformers' conv1d + sequential scan within float32 rounding
    (conv with bias, dt through x_proj / dt_proj + softplus, the dt/B/C norms, D skip, gate)."""
    mixer = mixers[name]
    x = _hidden(mixer, 29, batch=2)
    with torch.no_grad():
        want = mixer(x)
        got = torch.stack(R.mixer_step(mixer, list(x.unbind(0)), [None, None])[0])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_decode_equals_prefill_at_every_position(mixers, name):
    mixer = mixers[name]
    x = _hidden(mixer, 27, seed=1)[0]
    with torch.no_grad(), batch_invariant_mode():
        prefill = _run(mixer, x, [27])
        decode = _run(mixer, x, range(1, 28))
    assert_bitwise(decode, prefill, what=f"{name} Mamba-1 replay outputs", lhs_name="decode", rhs_name="prefill")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuts", [(1, 27), (2, 3, 27), (5, 13, 21, 27), (26, 27)], ids=lambda c: "-".join(map(str, c)))
def test_split_prefill_equals_unsplit(mixers, name, cuts):
    """Chunked prefill split shorter than the conv window (1, 2 tokens) and longer."""
    mixer = mixers[name]
    x = _hidden(mixer, 27, seed=2)[0]
    with torch.no_grad(), batch_invariant_mode():
        whole = _run(mixer, x, [27])
        split = _run(mixer, x, cuts)
    assert_bitwise(split, whole, what=f"{name} Mamba-1 replay outputs", lhs_name=f"split at {cuts[:-1]}",
                   rhs_name="unsplit")


@pytest.mark.parametrize("name", MODELS)
def test_state_and_crossed_positions_agree(mixers, name):
    """The state after a split prefill is the unsplit one's, bit for bit; the states crossed at
    multiples of `every` (what the engine's prefix cache keeps) are each reported once and equal
    the state of a prefill that stops there - so a cache hit resumes exactly."""
    mixer = mixers[name]
    x = _hidden(mixer, 27, seed=3)[0]
    with torch.no_grad(), batch_invariant_mode():
        _, (whole,), (crossed,) = R.mixer_step(mixer, [x], [None], 8)
        (_,), (part,), (first,) = R.mixer_step(mixer, [x[:11]], [None], 8)
        _, (part,), (second,) = R.mixer_step(mixer, [x[11:]], [part], 8)
        _, (at16,), _ = R.mixer_step(mixer, [x[:16]], [None])
        resumed = R.mixer_step(mixer, [x[16:]], [R.ReplayState(16, crossed[1].ssm, crossed[1].conv,
                                                               x.new_zeros(0, 1))])[0][0]
        tail = _run(mixer, x, [27])[16:]
    assert [c.position for c in crossed] == [8, 16, 24] == [c.position for c in first + second]
    assert whole.start == part.start == 27
    for a, b in ((whole.ssm, part.ssm), (whole.conv, part.conv), (crossed[1].ssm, at16.ssm),
                 (crossed[1].conv, at16.conv), (crossed[2].ssm, second[1].ssm)):
        assert_bitwise(a, b, what=f"{name} replay state", lhs_name="one path", rhs_name="another")
    assert_bitwise(resumed, tail, what=f"{name} resumed from a crossed state", lhs_name="resumed",
                   rhs_name="unsplit")


@pytest.mark.parametrize("name", MODELS)
def test_packed_equals_separate(mixers, name):
    """Sequences of different lengths in one call (some resumed from a state, some fresh) equal
    each one alone."""
    mixer = mixers[name]
    xs = [_hidden(mixer, n, seed=10 + n)[0] for n in (1, 3, 13, 30)]
    with torch.no_grad(), batch_invariant_mode():
        alone = [_run(mixer, x, [x.shape[0]]) for x in xs]
        together, _, _ = R.mixer_step(mixer, xs, [None] * len(xs))
        pre = [R.mixer_step(mixer, [x[:2]], [None])[1][0] if x.shape[0] > 2 else None for x in xs]
        rest, _, _ = R.mixer_step(mixer, [x[2:] if p is not None else x for x, p in zip(xs, pre)], pre)
    for i, (a, t, r) in enumerate(zip(alone, together, rest)):
        assert_bitwise(t, a, what=f"{name} sequence {i} of {len(xs)}", lhs_name="packed", rhs_name="alone")
        k = 2 if pre[i] is not None else 0
        assert_bitwise(r, a[k:], what=f"{name} sequence {i} resumed in a batch", lhs_name="resumed",
                       rhs_name="alone")


@pytest.mark.parametrize("name", MODELS)
def test_trainer_module_runs_the_replay(mixers, name):
    """An installed mixer runs the replay under the mode (packed rows via packed_sequences) and
    transformers' own forward outside it."""
    mixer = mixers[name]
    x = _hidden(mixer, 21, seed=4, batch=2)
    with torch.no_grad():
        stock = mixer(x)
        R.install(mixer)
        try:
            assert torch.equal(mixer(x), stock), "outside the mode the installed forward must be transformers'"
            with batch_invariant_mode():
                padded = mixer(x)
                with R.packed_sequences([0, 21, 34]):
                    packed = mixer(torch.cat([x[0], x[1, :13]])[None])[0]
                replay = torch.stack(R.mixer_step(mixer, list(x.unbind(0)), [None, None])[0])
        finally:
            del mixer.__dict__["_stock_forward"], mixer.__dict__["forward"]
    assert_bitwise(padded, replay, what="installed forward", lhs_name="module", rhs_name="mixer_step")
    assert_bitwise(packed, torch.cat([replay[0], replay[1, :13]]), what="packed row", lhs_name="packed",
                   rhs_name="padded")


@pytest.mark.parametrize("name", MODELS)
def test_stock_cache_continues_a_state(mixers, name):
    """The stock path (the negative controls' engine) continues a carried state: a prefill split
    in two through StockCache is transformers' one prefill within rounding. Control: without
    `stepwise_after_state` transformers' full-sequence scan restarts from zero and is far off -
    the reason the flag exists."""
    mixer = mixers[name]
    x = _hidden(mixer, 24, seed=6)
    with torch.no_grad():
        whole = mixer(x)[0]
        parts = []
        for stepwise in (True, False):
            cache = R.StockCache(stepwise_after_state=stepwise)
            parts.append(torch.cat([mixer(x[:, :10], cache=cache)[0], mixer(x[:, 10:], cache=cache)[0]]))
    torch.testing.assert_close(parts[0], whole, rtol=1e-5, atol=1e-6)
    far = (parts[1][10:] - whole[10:]).abs().max() / whole[10:].abs().max()
    assert far > 1e-2, f"the control: a restarted scan must be far off (relative {far:.1e})"


def _reversed_taps_in_decode(conv1d, lines, lens):
    """A planted variant of the conv: a decode step (every sequence one token) adds the taps in
    the reverse order - a rounding-only change (IEEE float adds, the same on every CPU)."""
    if any(n != 1 for n in lens):
        return _TAP_ORDER(conv1d, lines, lens)
    w = conv1d.weight[:, 0, :]
    pre = None
    for k in reversed(range(w.shape[1])):
        tap = torch.cat([line[k:k + n] for line, n in zip(lines, lens)]).to(w.dtype) * w[:, k]
        pre = tap if pre is None else pre + tap
    return pre + conv1d.bias if conv1d.bias is not None else pre


_TAP_ORDER = S._causal_conv


@pytest.mark.parametrize("name", MODELS)
def test_control_planted_tap_order_is_seen(mixers, name, monkeypatch):
    """Negative control of the prefill == decode comparison: with decode adding the conv's taps in
    another order, the same comparison fails. (transformers' own decode path equals its prefill
    under the batch-invariant kernels for Mamba-1 - measured - so a rounding-only plant is the
    control that exists on every machine.)"""
    mixer = mixers[name]
    x = _hidden(mixer, 27, seed=1)[0]
    monkeypatch.setattr(S, "_causal_conv", _reversed_taps_in_decode)
    with torch.no_grad(), batch_invariant_mode():
        prefill = _run(mixer, x, [27])
        decode = _run(mixer, x, range(1, 28))
    with pytest.raises(AssertionError, match="decode"):
        assert_bitwise(decode, prefill, what=f"{name} Mamba-1 replay outputs", lhs_name="decode", rhs_name="prefill")
