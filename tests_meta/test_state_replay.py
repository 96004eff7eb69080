"""Meta tests of the exact-replay state blocks the reference engine and trainer share:
fixtures/reference/mamba_replay.py (Mamba-2: Mamba2Mixer, NemotronH's, Bamba's, FalconH1's,
GraniteMoeHybrid's), selective_replay.py (Mamba-1: MambaMixer, FalconMambaMixer, JambaMambaMixer),
short_conv_replay.py (LFM2's Lfm2ShortConv) and delta_rule_replay.py (Qwen3-Next's, Qwen3.5's and
OLMo-hybrid's gated delta nets). Bitwise only between their own paths (prefill,
decode, splits, packing); against transformers' torch path with a tolerance (the same model, not
the same rounding)."""
from __future__ import annotations

import pytest
import torch

from fixtures.core.comparison import assert_bitwise
from fixtures.models.proxies import FAMILIES_DIR, build_proxy, load_model
from fixtures.reference import delta_rule_replay as DR
from fixtures.reference import mamba_replay as R
from fixtures.reference import selective_replay as S
from fixtures.reference import short_conv_replay as SC
from fixtures.reference.invariant_mode import batch_invariant_mode

# Mamba-2 (chunked scan). nemotron_h: n_groups = 2 (heads share B/C by group); the hybrid families
# are other classes of one mixer: bamba (BambaMixer), granitemoehybrid (GraniteMoeHybridMambaLayer),
# falcon_h1 (FalconH1Mixer: input multiplier, mup_vector, no gated norm)
MAMBA2 = ("mamba2", "nemotron_h", "bamba", "falcon_h1", "granitemoehybrid")
GROUPS = {"nemotron_h": 2, "bamba": 1, "falcon_h1": 1, "granitemoehybrid": 1}
# Mamba-1 (selective scan, no chunks). falcon_mamba: weightless RMSNorms on dt, B and C; jamba
# (JambaMambaMixer): the same norms with weights
SELECTIVE = ("mamba", "falcon_mamba", "jamba")
# the gated short conv (conv state only, no scan)
SHORT_CONV = ("lfm2",)
# gated delta nets: Qwen3-Next's fused projections, Qwen3.5's separate ones, OLMo-hybrid's q/k/v/g/b/a
# with o_norm / o_proj and beta doubled (allow_neg_eigval)
DELTA = ("qwen3_next", "qwen3_5_text", "olmo_hybrid")
NOT_CHUNKED = SELECTIVE + SHORT_CONV + DELTA
MODELS = MAMBA2 + NOT_CHUNKED


@pytest.fixture(scope="module")
def mixers(tmp_path_factory):
    """family -> the first state block of its tiny proxy (Mamba-2: chunk_size 8, conv_kernel 4;
    Mamba-1: conv_kernel 4, state 16; the short conv: conv_kernel 3)."""
    root = tmp_path_factory.mktemp("state_blocks")
    kind = {**{n: R.is_mamba_mixer for n in MAMBA2}, **{n: S.is_selective_mixer for n in SELECTIVE},
            **{n: SC.is_short_conv for n in SHORT_CONV}, **{n: DR.is_gated_delta_net for n in DELTA}}
    out = {}
    for name in MODELS:
        source = name if name in ("mamba2", "nemotron_h") else FAMILIES_DIR / name
        model = load_model(build_proxy(source, "tiny", root / name).path)
        out[name] = next(m for m in model.modules() if kind[name](m))
        assert R.is_state_mixer(out[name])
    return out


def _hidden(mixer, length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = mixer.hidden_size if hasattr(mixer, "hidden_size") else mixer.in_proj.in_features
    return torch.randn(batch, length, width, generator=g)


def _length(mixer, extra: int) -> int:
    """Three Mamba-2 chunks and a partial one; as long for the blocks without chunks."""
    return 3 * getattr(mixer, "chunk_size", 8) + extra


def _run(mixer, x: torch.Tensor, cuts) -> torch.Tensor:
    """The replay over x [T, hidden] fed in pieces ending at `cuts`, state carried between them."""
    state, outs, start = None, [], 0
    for end in cuts:
        (o,), (state,), _ = R.mixer_step(mixer, [x[start:end]], [state])
        outs.append(o)
        start = end
    return torch.cat(outs)


# ---------------------------------------------------------------------------------------------
# every state block
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_same_model_as_transformers(mixers, name):
    """A prefill of two sequences: transformers' torch path within float32 rounding (Mamba-2: the
    chunked scan over several chunks and a partial one - conv with bias, dt softplus + clamp, D
    skip, gated RMSNorm, groups; Mamba-1: conv1d + the sequential scan, dt through x_proj / dt_proj,
    the dt/B/C norms; the short conv: B * x before the conv and C after)."""
    mixer = mixers[name]
    if name in GROUPS or name == "mamba2":
        assert mixer.n_groups == GROUPS.get(name, 1)
    x = _hidden(mixer, _length(mixer, 5), batch=2)
    with torch.no_grad():
        want = mixer(x)
        got = torch.stack(R.mixer_step(mixer, list(x.unbind(0)), [None, None])[0])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_decode_equals_prefill_at_every_position(mixers, name):
    mixer = mixers[name]
    T = _length(mixer, 3)
    x = _hidden(mixer, T, seed=1)[0]
    with torch.no_grad(), batch_invariant_mode():
        prefill = _run(mixer, x, [T])
        decode = _run(mixer, x, range(1, T + 1))
    assert_bitwise(decode, prefill, what=f"{name} replay outputs", lhs_name="decode", rhs_name="prefill")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cuts", [(5, 27), (1, 9, 10, 27), (2, 3, 27), (3, 8, 19, 21, 27), (16, 27), (7, 15, 23, 27)],
                         ids=lambda c: "-".join(map(str, c)))
def test_split_prefill_equals_unsplit(mixers, name, cuts):
    """Chunked prefill split off and on Mamba-2 chunk boundaries (chunk_size 8), and shorter than
    the conv window (1, 2 tokens)."""
    mixer = mixers[name]
    x = _hidden(mixer, 27, seed=2)[0]
    with torch.no_grad(), batch_invariant_mode():
        whole = _run(mixer, x, [27])
        split = _run(mixer, x, cuts)
    assert_bitwise(split, whole, what=f"{name} replay outputs", lhs_name=f"split at {cuts[:-1]}",
                   rhs_name="unsplit")


@pytest.mark.parametrize("name", MODELS)
def test_packed_equals_separate(mixers, name):
    """Sequences of different lengths in one call (each chunked from its own position 0, some with
    state, some fresh) equal each one alone."""
    mixer = mixers[name]
    xs = [_hidden(mixer, n, seed=10 + n)[0] for n in (1, 8, 13, 30)]
    with torch.no_grad(), batch_invariant_mode():
        alone = [_run(mixer, x, [x.shape[0]]) for x in xs]
        together, _, _ = R.mixer_step(mixer, xs, [None] * len(xs))
        # resumed: the first 5 tokens of each long sequence before, the rest batched with others
        pre = [R.mixer_step(mixer, [x[:5]], [None])[1][0] if x.shape[0] > 5 else None for x in xs]
        rest, _, _ = R.mixer_step(mixer, [x[5:] if p is not None else x for x, p in zip(xs, pre)], pre)
    for i, (x, a, t, r) in enumerate(zip(xs, alone, together, rest)):
        assert_bitwise(t, a, what=f"{name} sequence {i} of {len(xs)}", lhs_name="packed", rhs_name="alone")
        k = 5 if pre[i] is not None else 0
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


# ---------------------------------------------------------------------------------------------
# Mamba-2: chunk boundaries, and transformers' recurrent decode as the control
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MAMBA2)
def test_state_and_boundaries_agree(mixers, name):
    """The state after a split prefill is the unsplit one's, bit for bit, and every chunk
    boundary crossed is reported once (what the engine's prefix cache keeps)."""
    mixer = mixers[name]
    Q = mixer.chunk_size
    x = _hidden(mixer, 2 * Q + 3, seed=3)[0]
    with torch.no_grad(), batch_invariant_mode():
        _, (whole,), (crossed,) = R.mixer_step(mixer, [x], [None])
        (_,), (part,), (first,) = R.mixer_step(mixer, [x[:Q + 1]], [None])
        _, (part,), (second,) = R.mixer_step(mixer, [x[Q + 1:]], [part])
    assert [b.position for b in crossed] == [Q, 2 * Q] == [b.position for b in first + second]
    assert whole.start == part.start == 2 * Q and whole.pending.shape[0] == part.pending.shape[0] == 3
    for a, b in ((whole.ssm, part.ssm), (whole.conv, part.conv), (whole.pending, part.pending),
                 (crossed[0].ssm, first[0].ssm)):
        assert_bitwise(a, b, what=f"{name} replay state", lhs_name="unsplit", rhs_name="split")


@pytest.mark.parametrize("name", MAMBA2)
def test_control_stock_recurrent_decode_differs(mixers, name):
    """Negative control: transformers' own cache path (chunked scan in prefill, the recurrent
    one-token update in decode) gives other bits in decode than in one prefill - even on the
    batch-invariant kernels, so the algorithm, not a kernel, is what the replay removes.
    Inconclusive (skipped) where it does not. 8 chunks: FalconH1's mixer (B, C and x scaled down
    by its mup_vector, no gated norm) adds so little of the state to the D skip that 3 chunks of
    decode showed no difference in its output (measured); 8 do."""
    mixer = mixers[name]
    T = 8 * mixer.chunk_size + 4
    x = _hidden(mixer, T, seed=5)
    with torch.no_grad(), batch_invariant_mode():
        prefill = mixer(x)[0]
        cache = R.StockCache()
        first = mixer(x[:, :4], cache=cache)[0]
        steps = [mixer(x[:, t:t + 1], cache=cache)[0] for t in range(4, T)]
    assert_bitwise(first, prefill[:4], what=f"{name} stock prefill", lhs_name="through the cache",
                   rhs_name="cacheless")
    decode = torch.cat(steps)
    if torch.equal(decode, prefill[4:]):
        pytest.skip(f"inconclusive on this hardware: the stock recurrent decode equalled the prefill ({name})")


# ---------------------------------------------------------------------------------------------
# Mamba-1 and the short conv: a state after every token, transformers' stock path, a planted control
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NOT_CHUNKED)
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


@pytest.mark.parametrize("name", NOT_CHUNKED)
def test_stock_cache_continues_a_state(mixers, name):
    """The stock path (the negative controls' engine) continues a carried state: a prefill split
    in two through StockCache is transformers' one prefill within rounding. Control (Mamba-1):
    without `stepwise_after_state` transformers' full-sequence scan restarts from zero and is far
    off - the reason the flag exists. The short conv has no scan and transformers' chunked delta
    rule takes the state: both ways continue."""
    mixer = mixers[name]
    x = _hidden(mixer, 24, seed=6)
    with torch.no_grad():
        whole = mixer(x)[0]
        parts = []
        for stepwise in (True, False):
            cache = R.StockCache(stepwise_after_state=stepwise)
            parts.append(torch.cat([mixer(x[:, :10], cache=cache)[0], mixer(x[:, 10:], cache=cache)[0]]))
    torch.testing.assert_close(parts[0], whole, rtol=1e-5, atol=1e-6)
    if name not in SELECTIVE:
        torch.testing.assert_close(parts[1], whole, rtol=1e-5, atol=1e-6)
        return
    far = (parts[1][10:] - whole[10:]).abs().max() / whole[10:].abs().max()
    assert far > 1e-2, f"the control: a restarted scan must be far off (relative {far:.1e})"


# Which calls a plant reverses, per comparison: the decode steps (every sequence one token), a call
# packing several sequences, or the pieces of a prefill split at token 5 (one sequence, fewer
# than its 27 tokens).
PLANTED_CALLS = {
    "decode": lambda lens: all(n == 1 for n in lens),
    "packed": lambda lens: len(lens) > 1,
    "split": lambda lens: len(lens) == 1 and 1 < lens[0] < 27,
}


def _planted_conv(planted):
    """A variant of the conv that adds the taps in reverse order in the calls `planted(lens)`
    picks - a rounding-only change (IEEE float adds, the same on every CPU)."""
    def conv(conv1d, lines, lens):
        if not planted(lens):
            return _TAP_ORDER(conv1d, lines, lens)
        w = conv1d.weight[:, 0, :]
        pre = None
        for k in reversed(range(w.shape[1])):
            tap = torch.cat([line[k:k + n] for line, n in zip(lines, lens)]).to(w.dtype) * w[:, k]
            pre = tap if pre is None else pre + tap
        return pre + conv1d.bias if conv1d.bias is not None else pre
    return conv


_TAP_ORDER = S.causal_conv


@pytest.mark.parametrize("name", NOT_CHUNKED)
@pytest.mark.parametrize("comparison", sorted(PLANTED_CALLS))
def test_control_planted_tap_order_is_seen(mixers, name, comparison, monkeypatch):
    """Negative control of each comparison above - prefill == decode, packed == alone, split ==
    unsplit: with one side's calls adding the conv's taps in another order, the same comparison
    fails. (transformers' own decode path equals its prefill under the batch-invariant kernels for
    Mamba-1 - measured - so a rounding-only plant is the control that exists on every machine.)"""
    mixer = mixers[name]
    x = _hidden(mixer, 27, seed=1)[0]
    for module in (S, SC, DR):
        monkeypatch.setattr(module, "causal_conv", _planted_conv(PLANTED_CALLS[comparison]))
    with torch.no_grad(), batch_invariant_mode():
        whole = _run(mixer, x, [27])
        if comparison == "decode":
            other = _run(mixer, x, range(1, 28))
        elif comparison == "split":
            other = _run(mixer, x, [5, 27])
        else:
            other = R.mixer_step(mixer, [x[:8], x], [None, None])[0][1]
    with pytest.raises(AssertionError, match=comparison):
        assert_bitwise(other, whole, what=f"{name} replay outputs", lhs_name=comparison, rhs_name="one prefill alone")


@pytest.mark.parametrize("use_kernels", [False, True], ids=["as-loaded", "control-hub-kernels-on"])
def test_the_install_survives_train_and_eval(tmp_path, use_kernels):
    """load_model turns transformers' hub kernels off: with them on (transformers' default since
    5.2x, where the `kernels` package is installed) every train() / eval() re-kernelizes and drops
    an instance's forward from a kernel-registered layer - measured on Qwen3.5's gated delta net,
    whose replay then silently gave way to transformers' chunked rule. Control: loaded with
    use_kernels=True, the install is seen to be lost."""
    from fixtures.models.proxies import load_model
    path = build_proxy(FAMILIES_DIR / "qwen3_5_text", "tiny", tmp_path / "p").path
    if use_kernels:
        pytest.importorskip("kernels", reason="the control needs the kernels package transformers uses")
    model = load_model(path, **({"use_kernels": True} if use_kernels else {}))
    assert R.install(model) == 1
    model.train()
    model.eval()
    kept = [type(m).__name__ for m in model.modules() if m.__dict__.get("forward") is not None
            and m.__dict__["forward"].__func__ is R._replay_forward]
    assert kept == ([] if use_kernels else ["Qwen3_5GatedDeltaNet"])
