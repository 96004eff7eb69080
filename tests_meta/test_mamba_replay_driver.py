"""fixtures.vllm.mamba_replay_driver on the CPU, with the scan kernel's CPU twin
(fixtures.vllm.mamba_scan_twin): design docs/design/mamba2-and-fp8.md §C.2 (iv), step E.3.

What is checked here, and only here (not yet run on a GPU; the `replay` probe of
benchmarks/mamba2_kernels_gpu.py is the same check with vLLM's kernel):
- drawn schedules (several requests, each a few prefill pieces of drawn sizes then decode steps of
  1 token, drawn subsets of them per engine step, in drawn cache slots) give every token the bits
  of one unsplit scan call per sequence; after every step each slot's fp32 boundary state equals
  the unsplit call's state at that boundary, its pending rows are the sequence's rows since it,
  and the chunk states of the boundaries crossed (what a prefix cache keeps) are the unsplit ones;
- planted driver faults are seen red: the boundary state written from a partial chunk, the pending
  rows dropped, the pending rows re-run as zeros;
- the twin itself: it honours the chunk metadata (a mid-chunk logical chunk gives other bits), a
  partial chunk is a prefix of the full one, and it refuses what it cannot compute.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, note, settings, strategies as st

from fixtures.vllm import mamba_replay_driver as MD
from fixtures.vllm.mamba_replay_plan import plan
from fixtures.vllm.mamba_scan_twin import a_log_of, scan_twin

H, P, N, G = 4, 2, 4, 2          # heads, head dim, state, groups (2 heads per group)


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)           # as MambaMixer2 loads it
    return {"A": A, "D": torch.randn(H, generator=g), "dt_bias": torch.randn(H, generator=g) * 0.5}


def _sequence(length: int, seed: int, with_z: bool) -> dict:
    """Post-conv x, B, C and raw dt (and z) of one sequence, bf16 as the engine has them."""
    g = torch.Generator().manual_seed(10_000 + seed)
    bf = torch.bfloat16
    seq = {"x": torch.randn(length, H, P, generator=g).to(bf), "dt": (torch.randn(length, H, generator=g) * 0.5).to(bf),
           "B": torch.randn(length, G, N, generator=g).to(bf), "C": torch.randn(length, G, N, generator=g).to(bf)}
    seq["z"] = torch.randn(length, H, P, generator=g).to(bf) if with_z else None
    return seq


def unsplit(seq: dict, prm: dict, Q: int):
    """One scan call over the whole sequence from position 0: (out [L, H, P] fp32, every chunk's end state)."""
    L = seq["x"].shape[0]
    t = plan([0], [L], Q).tensors()
    out = torch.empty(L, H, P)
    states = scan_twin(seq["x"], seq["dt"], prm["A"], seq["B"], seq["C"], Q, t["cu_seqlens"], t["cu_chunk_seqlens"],
                       t["last_chunk_indices"], t["seq_idx"], out, D=prm["D"], z=seq["z"], dt_bias=prm["dt_bias"],
                       dt_softplus=True, return_intermediate_states=True, state_dtype=torch.float32)
    return out, states


def run(Q: int, seqs: list, steps: list, slots: list, prm: dict, with_z: bool) -> list[str]:
    """Drive the sequences through `steps` (each a list of (sequence, new tokens)) in `slots`, and
    return what differs from the unsplit calls (empty: all bits equal)."""
    w = MD.Widths(H, P, N, G, Q, with_z)
    drv = MD.ReplayDriver(w, max(slots) + 2, A=prm["A"], scan=scan_twin, D=prm["D"], dt_bias=prm["dt_bias"])
    drv.ssm.normal_()                                 # stale state from earlier requests: reset must clear it
    drv.pending.normal_()
    drv.position = [7] * len(drv.position)
    ref = [unsplit(s, prm, Q) for s in seqs]
    outs: list = [[] for _ in seqs]
    pos = [0] * len(seqs)
    bad = []
    for n_step, step in enumerate(steps):
        js = [j for j, _ in step]
        for j in js:
            if pos[j] == 0:
                drv.reset(slots[j])
        lens = [n for _, n in step]
        cat = {k: torch.cat([seqs[j][k][pos[j]:pos[j] + n] for j, n in step]) for k in ("x", "dt", "B", "C")}
        z = torch.cat([seqs[j]["z"][pos[j]:pos[j] + n] for j, n in step]) if with_z else None
        y = drv.step([slots[j] for j in js], [pos[j] for j in js], cat["x"], cat["dt"], cat["B"], cat["C"], lens,
                     z=z, out=torch.empty(sum(lens), H, P))
        p, states = drv.last_plan, drv.last_chunk_states
        for i, ((j, n), part) in enumerate(zip(step, y.split(lens))):
            outs[j].append(part)
            pos[j] += n
            s, b = slots[j], drv.boundary(slots[j])
            want = ref[j][1][b // Q - 1] if b else torch.zeros(H, P, N)
            if not torch.equal(drv.ssm[s], want):
                bad.append(f"step {n_step}: seq {j} boundary state at {b} differs")
            live = MD.pack_rows(w, *(seqs[j][k][b:pos[j]] for k in ("x", "dt", "B", "C")),
                                z=seqs[j]["z"][b:pos[j]] if with_z else None)
            if not torch.equal(drv.pending_rows(s), live):
                bad.append(f"step {n_step}: seq {j} pending rows {b}..{pos[j]} differ")
            for at, c in p.boundaries[i]:
                if not torch.equal(states[c], ref[j][1][at // Q - 1]):
                    bad.append(f"step {n_step}: seq {j} chunk state at boundary {at} differs")
    for j, s in enumerate(seqs):
        got, want = torch.cat(outs[j]), ref[j][0]
        if not torch.equal(got, want):
            rows = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
            bad.append(f"seq {j} (L={s['x'].shape[0]}): outputs differ at rows {rows[:6]}{'...' if len(rows) > 6 else ''}")
    return bad


@st.composite
def schedules(draw):
    """Q, sequences (lengths crossing several chunk boundaries), and engine steps: each sequence's
    prefill pieces of drawn sizes then decode steps of 1, the requests of each step a drawn subset
    of those with tokens left, each sequence in a drawn cache slot."""
    Q = draw(st.sampled_from([8, 16]), label="Q")
    lengths = draw(st.lists(st.integers(Q + 1, 3 * Q + 3), min_size=2, max_size=3), label="lengths")
    pieces = []
    for j, L in enumerate(lengths):
        prefill = draw(st.integers(1, L), label=f"seq {j} prefill")
        sizes, left = [], prefill
        while left:
            sizes.append(draw(st.integers(1, min(left, 2 * Q + 3)), label=f"seq {j} piece"))
            left -= sizes[-1]
        decode = min(L - prefill, Q + 2)          # decode steps kept short on the CPU; the rest is prefill
        pieces.append(sizes + [L - prefill - decode] * (L - prefill > decode) + [1] * decode)
    steps, todo = [], [list(p) for p in pieces]
    while any(todo):
        ready = [j for j, t in enumerate(todo) if t]
        pick = draw(st.lists(st.sampled_from(ready), min_size=1, unique=True), label="step") if len(ready) > 1 else ready
        steps.append([(j, todo[j].pop(0)) for j in sorted(pick)])
    slots = draw(st.permutations(range(len(lengths) + 1)), label="slots")[:len(lengths)]
    return Q, lengths, steps, slots


@given(sched=schedules(), seed=st.integers(0, 3), with_z=st.booleans())
@settings(max_examples=25, deadline=None)
def test_drawn_schedules_give_the_unsplit_bits_and_boundary_states(sched, seed, with_z):
    Q, lengths, steps, slots = sched
    note(f"Q={Q} lengths={lengths} slots={slots} steps={steps}")
    prm = _params(seed)
    seqs = [_sequence(L, 100 * seed + j, with_z) for j, L in enumerate(lengths)]
    with torch.no_grad():
        bad = run(Q, seqs, steps, slots, prm, with_z)
    assert not bad, "\n".join(bad[:8])


# ---------------------------------------------------------------------------------------------
# planted faults: the same fixed schedule, the driver broken one way at a time
# ---------------------------------------------------------------------------------------------
FIXED = (8, [30, 19], [[(0, 5), (1, 3)], [(0, 7)], [(0, 1), (1, 9)], [(0, 1), (1, 1)], [(0, 1)], [(0, 10), (1, 1)],
                       [(0, 1), (1, 5)], [(0, 1)], [(0, 1)], [(0, 1)], [(0, 1)]], [2, 0])


def _plant_boundary_from_partial(mp):
    orig = MD.SlotIndex.of

    def of(p, slots, device=None):
        idx = orig(p, slots, device)
        return dataclasses.replace(idx, state_slot=idx.slots.clone(),
                                   state_chunk=torch.tensor(p.last_chunk_indices, dtype=torch.int64))
    mp.setattr(MD.SlotIndex, "of", staticmethod(of))


def _plant_pending_zeroed(mp):
    orig = MD.gather_rows

    def gather(idx, new_rows, pending, num_rows):
        R = orig(idx, new_rows, pending, num_rows)
        return R.index_fill_(0, idx.pend_dst, 0) if idx.pend_dst.numel() else R
    mp.setattr(MD, "gather_rows", gather)


FAULTS = {"boundary state written from each request's last chunk, partial or not": _plant_boundary_from_partial,
          "pending rows dropped (never written)": lambda mp: mp.setattr(MD, "write_pending", lambda *a: None),
          "pending rows re-run as zeros (the gather misses them)": _plant_pending_zeroed}


def test_fixed_schedule_is_green():
    Q, lengths, steps, slots = FIXED
    prm = _params(1)
    with torch.no_grad():
        assert run(Q, [_sequence(L, j, False) for j, L in enumerate(lengths)], steps, slots, prm, False) == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_planted_driver_fault_is_seen_red(fault, monkeypatch):
    Q, lengths, steps, slots = FIXED
    prm = _params(1)
    FAULTS[fault](monkeypatch)
    with torch.no_grad():
        bad = run(Q, [_sequence(L, j, False) for j, L in enumerate(lengths)], steps, slots, prm, False)
    assert any("outputs differ" in b for b in bad), f"{fault}: not seen ({bad})"


# ---------------------------------------------------------------------------------------------
# the driver's refusals
# ---------------------------------------------------------------------------------------------
def _small_driver(Q=8):
    prm = _params(0)
    return MD.ReplayDriver(MD.Widths(H, P, N, G, Q), 4, A=prm["A"], scan=scan_twin, D=prm["D"], dt_bias=prm["dt_bias"])


def test_a_slot_out_of_step_or_shared_is_refused():
    drv, s = _small_driver(), _sequence(5, 0, False)
    with pytest.raises(ValueError, match="stands at 0 tokens, the step says 3"):
        drv.step([1], [3], s["x"], s["dt"], s["B"], s["C"], [5])
    both = {k: torch.cat([s[k][:2], s[k][2:4]]) for k in ("x", "dt", "B", "C")}
    with pytest.raises(ValueError, match="distinct cache slots"):
        drv.step([1, 1], [0, 0], both["x"], both["dt"], both["B"], both["C"], [2, 2])
    with pytest.raises(ValueError, match="one dtype"):
        drv.step([1], [0], s["x"], s["dt"].float(), s["B"], s["C"], [5])
    drv.step([1], [0], s["x"], s["dt"], s["B"], s["C"], [5])
    drv.reset(1)
    assert drv.position[1] == 0 and not drv.ssm[1].any() and not drv.pending[1].any()


# ---------------------------------------------------------------------------------------------
# the twin
# ---------------------------------------------------------------------------------------------
def _call(seq, prm, Q, computed=0, init=None, cu_chunk=None, out_dtype=torch.float32):
    L = seq["x"].shape[0]
    t = plan([computed], [L], Q).tensors()
    out = torch.empty(L, H, P, dtype=out_dtype)
    cc = t["cu_chunk_seqlens"] if cu_chunk is None else torch.tensor(cu_chunk, dtype=torch.int32)
    sidx = torch.zeros(len(cc) - 1, dtype=torch.int32)
    states = scan_twin(seq["x"], seq["dt"], prm["A"], seq["B"], seq["C"], Q, t["cu_seqlens"], cc,
                       torch.tensor([len(cc) - 2], dtype=torch.int32), sidx, out, D=prm["D"], dt_bias=prm["dt_bias"],
                       initial_states=init, dt_softplus=True, return_intermediate_states=True,
                       state_dtype=torch.float32)
    return out, states


def test_twin_partial_chunk_is_a_prefix_and_chunking_matters():
    """Rows of the first j tokens alone = the first j rows of the full call (§C.2 ii, on the twin);
    the same rows cut into logical chunks at 3 instead of 8 (a mid-chunk start) give other bits."""
    Q, prm = 8, _params(2)
    seq = _sequence(2 * Q + 3, 7, False)
    with torch.no_grad():
        full, states = _call(seq, prm, Q)
        for j in (1, 5, Q - 1, Q, Q + 1, 2 * Q + 1):
            part, pst = _call({k: (v[:j] if v is not None else None) for k, v in seq.items()}, prm, Q)
            assert torch.equal(part, full[:j]), j
            if j % Q == 0:
                assert torch.equal(pst[-1], states[j // Q - 1])
        shifted, _ = _call(seq, prm, Q, cu_chunk=[0, 3, 3 + Q, 2 * Q + 3])
    assert torch.equal(shifted[:3], full[:3]) and not torch.equal(shifted[3:], full[3:])


def test_twin_refuses_what_it_cannot_compute():
    prm, seq = _params(0), _sequence(4, 0, False)
    with pytest.raises(NotImplementedError, match="dt_softplus"):
        t = plan([0], [4], 8).tensors()
        scan_twin(seq["x"], seq["dt"], prm["A"], seq["B"], seq["C"], 8, t["cu_seqlens"], t["cu_chunk_seqlens"],
                  t["last_chunk_indices"], t["seq_idx"], torch.empty(4, H, P), dt_softplus=False)
    with pytest.raises(ValueError, match="does not fit"):
        _call(seq, prm, 2, cu_chunk=[0, 4])                               # a chunk longer than Q
    A = torch.tensor([-1.0, -2.0, -3.0, -5.0])
    assert torch.equal(-torch.exp(a_log_of(A)), A)
    with pytest.raises(ValueError, match="not -exp"):
        a_log_of(torch.tensor([1.0, -2.0, -3.0, -5.0]))
