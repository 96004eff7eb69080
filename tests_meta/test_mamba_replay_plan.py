"""fixtures.vllm.mamba_replay_plan on the CPU (design docs/design/mamba2-and-fp8.md step E.0).

Three things, none of which claims anything about a GPU:
- the plan's arrays have the shape `mamba_chunk_scan_combined_varlen` expects, with every request
  chunked from its own last boundary (hand-checked examples and drawn batches);
- the plan agrees with the reference engine's bookkeeping (fixtures/reference/mamba_replay.py
  `ssd_replay`: boundary, pending, boundaries crossed, the replayed rows) step by step over drawn
  schedules: prefill splits anywhere, decode steps, prefix-cache resumes at chunk boundaries, all
  mixed in batches;
- an end-to-end CPU twin: the reference's own chunked SSD arithmetic, called per logical chunk as
  the plan's arrays say (the "kernel"), driven by the plan with fp32 boundary states and pending
  rows, gives every token the same bits whatever the schedule - the property the `mamba2` fix must
  give. The negative control, a plan that aligns chunks at the resume point (and carries the state
  after the last token), gives different bits on a mid-chunk split.

The twin's mixer has an identity conv (kernel 1, weight 1, bias 0): in the fix the conv stays
vLLM's own, outside the plan, and the pending rows are the post-conv inputs, so here they equal the
reference's pre-conv pending rows exactly.
"""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fixtures.reference import mamba_replay as R
from fixtures.reference.invariant_mode import batch_invariant_mode
from fixtures.vllm import mamba_replay_plan as MP

H, P, N, G = 2, 2, 4, 1          # heads, head dim, state, groups
CD = H * P + 2 * G * N           # conv dim (x, B, C)
WIDTH = CD + H                   # a row: post-conv x, B, C and raw dt


def _mixer(Q: int, seed: int = 0):
    """The attributes ssd_replay reads off a Mamba-2 mixer, with an identity conv."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.nn.Conv1d(CD, CD, 1, groups=CD, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        conv.bias.zero_()
    return types.SimpleNamespace(
        num_heads=H, head_dim=P, ssm_state_size=N, n_groups=G, conv_kernel_size=1, intermediate_size=H * P,
        conv_dim=CD, chunk_size=Q, time_step_limit=(0.0, float("inf")), conv1d=conv, act=torch.nn.Identity(),
        dt_bias=(torch.randn(H, generator=g) * 0.5).bfloat16(), A_log=torch.randn(H, generator=g) * 0.5,
        D=torch.randn(H, generator=g))


def _rows(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(length, WIDTH, generator=g)).bfloat16()


# ---------------------------------------------------------------------------------------------
# the arrays
# ---------------------------------------------------------------------------------------------
def test_plan_of_a_mixed_batch_by_hand():
    """Q = 4: a decode at position 6 (2 pending), a fresh 9-token prefill, a continued prefill from
    5 (1 pending) completing 2 chunks, a prefix-cache resume at 8 (no pending)."""
    p = MP.plan([6, 0, 5, 8], [1, 9, 7, 3], 4)
    assert p.boundary == (4, 0, 4, 8) and p.kept == (2, 0, 1, 0)
    assert p.has_initial_state == (True, False, True, True)
    assert p.query_start_loc == (0, 1, 10, 17, 20)
    assert p.cu_seqlens == (0, 3, 12, 20, 23)
    assert p.cu_chunk_seqlens == (0, 3, 7, 11, 12, 16, 20, 23)
    assert p.seq_idx == (0, 1, 1, 1, 2, 2, 3)
    assert p.last_chunk_indices == (0, 3, 5, 6)
    assert p.chunk_start == (4, 0, 4, 8, 4, 8, 8)
    T, W = 20, 3
    assert p.gather == (T + 0, T + 1, 0) + tuple(range(1, 10)) + (T + 2 * W,) + tuple(range(10, 17)) + (17, 18, 19)
    assert p.output_rows == (2,) + tuple(range(3, 12)) + tuple(range(13, 20)) + (20, 21, 22)
    assert p.state_chunk == (-1, 2, 5, -1)
    assert p.boundaries == ((), ((4, 1), (8, 2)), ((8, 4), (12, 5)), ())
    assert p.new_boundary == (4, 8, 12, 8) and p.new_pending == (3, 1, 0, 3)
    assert p.pending_src == (0, 1, 2, 11, 20, 21, 22)
    assert p.pending_dst == (0, 1, 2, 3, 9, 10, 11)
    t = p.tensors()
    assert t["cu_chunk_seqlens"].dtype == torch.int32 and t["gather"].dtype == torch.int64
    assert t["state_chunk"].tolist() == [-1, 2, 5, -1]


@pytest.mark.parametrize("bad", [0, 3, 6, -4, 2.0])
def test_chunk_size_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        MP.plan([0], [1], bad)


@pytest.mark.parametrize("computed,lens", [([0], [0]), ([-1], [2]), ([0, 1], [1])])
def test_bad_requests_are_refused(computed, lens):
    with pytest.raises(ValueError):
        MP.plan(computed, lens, 4)


@given(Q=st.sampled_from([1, 2, 4, 8, 16]),
       reqs=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40)), min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_plan_arrays_are_chunk_aligned(Q, reqs):
    """Every logical chunk lies in one request, starts at an absolute multiple of Q and holds at
    most Q rows; only a request's last chunk may be partial; the gather reads each request's k
    pending rows then its n new rows; the outputs are exactly the new rows; the new pending is
    the rows after the last boundary."""
    computed, lens = [c for c, _ in reqs], [n for _, n in reqs]
    p = MP.plan(computed, lens, Q)
    T, W = sum(lens), Q - 1
    assert len(p.gather) == p.num_rows and sorted(p.output_rows) == list(p.output_rows)
    for i, (p0, n) in enumerate(reqs):
        a, e = p.cu_seqlens[i], p.cu_seqlens[i + 1]
        k = p0 % Q
        assert e - a == k + n and p.boundary[i] == p0 - k
        chunks = [c for c, s in enumerate(p.seq_idx) if s == i]
        assert chunks == list(range(chunks[0], chunks[-1] + 1)) and p.last_chunk_indices[i] == chunks[-1]
        assert p.cu_chunk_seqlens[chunks[0]] == a and p.cu_chunk_seqlens[chunks[-1] + 1] == e
        for c in chunks:
            size = p.cu_chunk_seqlens[c + 1] - p.cu_chunk_seqlens[c]
            assert 0 < size <= Q and (size == Q or c == chunks[-1])
            assert p.chunk_start[c] % Q == 0 and p.chunk_start[c] == p.boundary[i] + p.cu_chunk_seqlens[c] - a
        assert p.gather[a:e] == tuple(T + i * W + j for j in range(k)) + tuple(range(p.query_start_loc[i],
                                                                                   p.query_start_loc[i + 1]))
        assert p.output_rows[p.query_start_loc[i]:p.query_start_loc[i + 1]] == tuple(range(a + k, e))
        full = (k + n) // Q
        assert p.new_boundary[i] == p.boundary[i] + full * Q and p.new_boundary[i] + p.new_pending[i] == p0 + n
        assert p.new_pending[i] < Q and [b for b, _ in p.boundaries[i]] == [p.boundary[i] + (c + 1) * Q
                                                                            for c in range(full)]
        assert p.state_chunk[i] == (p.boundaries[i][-1][1] if full else -1)
    assert len(p.pending_src) == len(p.pending_dst) == sum(p.new_pending)
    assert len(set(p.pending_dst)) == len(p.pending_dst) and all(0 <= d < len(reqs) * W for d in p.pending_dst)


# ---------------------------------------------------------------------------------------------
# the twin: the reference's arithmetic as the kernel, the plan as the driver
# ---------------------------------------------------------------------------------------------
def _neutral(rows: torch.Tensor, Q: int) -> torch.Tensor:
    """Pad a partial chunk to Q rows that change nothing: x, B, C = 0 and raw dt = -inf (so dt =
    softplus(-inf) = 0, a decay of exp(0) = 1 and no contribution), so the chunk's end state is
    the state after its last real row. The real rows' outputs never see later rows."""
    pad = rows.new_zeros(Q - rows.shape[0], WIDTH)
    pad[:, CD:] = float("-inf")
    return torch.cat([rows, pad])


def twin_varlen_scan(mixer, rows: torch.Tensor, p: MP.ReplayPlan, init: torch.Tensor):
    """mamba_chunk_scan_combined_varlen's contract on the CPU: packed rows [T_R, WIDTH] chunked as
    p.cu_chunk_seqlens / p.seq_idx say, request i from init[i] (fp32); returns the outputs
    [T_R, H * P] (fp32) and the state after each logical chunk ([C, H, P, N]; what
    return_intermediate_states=True gives). Each chunk runs through ssd_replay at the full chunk
    shape; chunks of one rank (the r-th of their request) share a call."""
    Q, C = p.chunk_size, len(p.seq_idx)
    out = torch.zeros(rows.shape[0], H * P)
    ends: list = [None] * C
    rank = [0] * C
    for c in range(1, C):
        rank[c] = rank[c - 1] + 1 if p.seq_idx[c] == p.seq_idx[c - 1] else 0
    empty_conv = rows.new_zeros(0, CD)
    empty_pending = rows.new_zeros(0, WIDTH)
    for r in range(max(rank, default=-1) + 1):
        cs = [c for c in range(C) if rank[c] == r]
        inputs, states = [], []
        for c in cs:
            a, e, i = p.cu_chunk_seqlens[c], p.cu_chunk_seqlens[c + 1], p.seq_idx[c]
            assert p.cu_seqlens[i] <= a < e <= p.cu_seqlens[i + 1] and e - a <= Q, (c, a, e)
            inputs.append(_neutral(rows[a:e], Q))
            states.append(R.ReplayState(p.chunk_start[c], init[i] if r == 0 else ends[c - 1], empty_conv, empty_pending))
        ys, _, bounds = R.ssd_replay(mixer, inputs, states)
        for c, y, crossed in zip(cs, ys, bounds):
            a, e = p.cu_chunk_seqlens[c], p.cu_chunk_seqlens[c + 1]
            out[a:e] = y[:e - a]
            ends[c] = crossed[0].ssm
    return out, ends


class Driver:
    """The engine side of the fix on the CPU: per sequence a fp32 boundary state and Q - 1 pending
    rows (the cache slots), each step planned, gathered, run by the twin, scattered.

    mode "replay": the plan (chunks from position 0, the boundary state, pending re-run).
    mode "resume": the negative control, chunks aligned at each step's resume point: no pending,
    the state after the last token carried from step to step."""

    def __init__(self, mixer, Q: int, mode: str = "replay"):
        self.mixer, self.Q, self.mode = mixer, Q, mode
        self.state: dict = {}          # seq -> fp32 [H, P, N]
        self.pending: dict = {}        # seq -> [Q - 1, WIDTH]
        self.computed: dict = {}       # seq -> tokens behind it
        self.snaps: dict = {}          # seq -> {position: state}: boundaries crossed (a prefix cache)
        self.plans: list = []

    def resume(self, seq, position: int, state: torch.Tensor):
        """A prefix-cache hit: seq starts at `position` (a boundary) from a cached boundary state."""
        assert position % self.Q == 0
        self.state[seq], self.computed[seq] = state.clone(), position
        self.pending[seq] = torch.zeros(self.Q - 1, WIDTH, dtype=torch.bfloat16)

    def step(self, batch: list[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
        Q, W = self.Q, self.Q - 1
        for seq, _ in batch:
            if seq not in self.computed:
                self.resume(seq, 0, torch.zeros(H, P, N))
        computed = [self.computed[s] for s, _ in batch]
        lens = [new.shape[0] for _, new in batch]
        p = MP.plan(computed if self.mode == "replay" else [0] * len(batch), lens, Q)
        self.plans.append(p)
        new = torch.cat([x for _, x in batch])
        pend = torch.cat([self.pending[s] for s, _ in batch]) if W else new.new_zeros(0, WIDTH)
        rows = torch.cat([new, pend])[list(p.gather)]
        if self.mode == "replay":
            init = torch.stack([self.state[s] if has else torch.zeros(H, P, N)
                                for (s, _), has in zip(batch, p.has_initial_state)])
        else:
            init = torch.stack([self.state[s] for s, _ in batch])
        out, ends = twin_varlen_scan(self.mixer, rows, p, init)
        flat = pend.clone()
        for d, s_ in zip(p.pending_dst, p.pending_src):
            flat[d] = rows[s_]
        for i, (seq, _) in enumerate(batch):
            if self.mode == "replay":
                if p.state_chunk[i] >= 0:
                    self.state[seq] = ends[p.state_chunk[i]]
                for pos, c in p.boundaries[i]:
                    self.snaps.setdefault(seq, {})[pos] = ends[c]
                self.pending[seq] = flat[i * W:(i + 1) * W]
            else:
                self.state[seq] = ends[p.last_chunk_indices[i]]
            self.computed[seq] += lens[i]
        ys = out[list(p.output_rows)]
        return list(ys.split(lens))


def _split(length: int, cuts: list[int]) -> list[int]:
    """Piece sizes of a sequence cut at the given positions (0 < cut < length)."""
    edges = [0] + sorted(set(c for c in cuts if 0 < c < length)) + [length]
    return [b - a for a, b in zip(edges, edges[1:])]


def _unsplit(mixer, Q: int, rows: torch.Tensor) -> torch.Tensor:
    return Driver(mixer, Q).step([("alone", rows)])[0]


@st.composite
def schedules(draw):
    """Sequences (some resumed from a prefix-cache hit on another's boundary) cut into prefill
    pieces and decode steps, and the order their pieces go into shared engine steps."""
    Q = draw(st.sampled_from([2, 4, 8]), label="Q")
    base = draw(st.lists(st.integers(1, 3 * Q + 3), min_size=1, max_size=3), label="base lengths")
    seqs = []
    for j, length in enumerate(base):
        prefill = draw(st.integers(1, length), label=f"seq {j} prefill")
        cuts = draw(st.lists(st.integers(1, max(1, prefill - 1)), max_size=3), label=f"seq {j} cuts")
        seqs.append({"len": length, "donor": None, "at": 0,
                     "pieces": _split(prefill, cuts) + [1] * (length - prefill)})
    for donor in range(len(base)):
        blocks = base[donor] // Q
        if blocks and draw(st.booleans(), label=f"resume from seq {donor}"):
            at = Q * draw(st.integers(1, blocks), label="resume block")
            tail = draw(st.integers(1, 2 * Q + 1), label="tail")
            seqs.append({"len": at + tail, "donor": donor, "at": at, "pieces": _split(tail, [tail // 2])})
    return Q, seqs


def _run(mixer, Q, seqs, data, mode="replay", reference=True):
    """Drive every sequence through shared steps (which of the ready ones go into each step is
    drawn). Returns {seq: rows}, {seq: outputs}; with `reference`, the reference engine
    (ssd_replay with ReplayStates) runs the same steps beside, and each step's plan is checked
    against its bookkeeping and its outputs."""
    rows = {}
    for j, s in enumerate(seqs):
        rows[j] = _rows(s["len"], j) if s["donor"] is None else \
            torch.cat([rows[s["donor"]][:s["at"]], _rows(s["len"] - s["at"], j)])
    drv = Driver(mixer, Q, mode)
    ref_state: dict = {}
    ref_snaps: dict = {}
    outs = {j: [] for j in rows}
    left = {j: list(s["pieces"]) for j, s in enumerate(seqs)}
    while any(left.values()):
        ready = [j for j in left if left[j] and (seqs[j]["donor"] is None or j in drv.computed
                                                 or seqs[j]["at"] in drv.snaps.get(seqs[j]["donor"], {}))]
        pick = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True), label="step") if len(ready) > 1 \
            else ready
        batch = []
        for j in sorted(pick):
            if j not in drv.computed and seqs[j]["donor"] is not None:
                at = seqs[j]["at"]
                drv.resume(j, at, drv.snaps[seqs[j]["donor"]][at])
                if reference:
                    st_ = ref_snaps[seqs[j]["donor"]][at]
                    ref_state[j] = R.ReplayState(at, st_[0].clone(), st_[1], torch.zeros(0, WIDTH, dtype=torch.bfloat16))
            pos = drv.computed.get(j, 0)
            n = left[j].pop(0)
            batch.append((j, rows[j][pos:pos + n]))
        before = {j: (ref_state[j].start, ref_state[j].pending.clone()) if j in ref_state else (0, None)
                  for j, _ in batch}
        got = drv.step(batch)
        if reference:
            p = drv.plans[-1]
            ys, new, bounds = R.ssd_replay(mixer, [x for _, x in batch], [ref_state.get(j) for j, _ in batch])
            for i, (j, x) in enumerate(batch):
                start, pending = before[j]
                k = 0 if pending is None else pending.shape[0]
                assert (p.boundary[i], p.kept[i]) == (start, k), (i, p)
                gathered = torch.cat([pending, x]) if k else x
                assert p.new_boundary[i] == new[i].start and p.new_pending[i] == new[i].pending.shape[0]
                assert [b for b, _ in p.boundaries[i]] == [b.position for b in bounds[i]]
                # the twin reproduces the reference engine's step: outputs, boundary states, pending
                assert torch.equal(got[i], ys[i]), (i, j)
                assert torch.equal(drv.state[j], new[i].ssm) and torch.equal(
                    drv.pending[j][:p.new_pending[i]], new[i].pending)
                assert torch.equal(gathered[len(gathered) - p.new_pending[i]:], new[i].pending)
                ref_state[j] = new[i]
                for b in bounds[i]:
                    ref_snaps.setdefault(j, {})[b.position] = (b.ssm, b.conv)
        for (j, _), y in zip(batch, got):
            outs[j].append(y)
    return rows, {j: torch.cat(o) for j, o in outs.items()}


@given(sched=schedules(), data=st.data())
@settings(max_examples=100, deadline=None)
def test_plan_follows_the_reference_and_every_schedule_gives_the_unsplit_bits(sched, data):
    Q, seqs = sched
    mixer = _mixer(Q)
    with torch.no_grad(), batch_invariant_mode():
        rows, outs = _run(mixer, Q, seqs, data)
        for j, x in rows.items():
            # a resumed sequence ran its tail only: from the cached boundary state, the tail of its unsplit run
            want = _unsplit(mixer, Q, x)[seqs[j]["at"]:]
            assert torch.equal(outs[j], want), (j, seqs[j], (outs[j] != want).nonzero()[:4].tolist())


class _Fixed:
    """st.data() stand-in for a fixed schedule: every ready sequence goes into each step."""
    def draw(self, strategy, label=None):
        raise AssertionError("one ready sequence at a time")


@pytest.mark.parametrize("Q,pieces", [(4, [5, 1, 1, 4]), (8, [3, 1, 1, 1, 9]), (4, [1] * 11)])
def test_negative_control_chunks_aligned_at_the_resume_point_differ(Q, pieces):
    """The same mid-chunk schedule through the control plan (chunks from each step's resume point,
    the state after the last token carried) gives other bits than unsplit; the replay plan gives
    the unsplit bits. Seen red, so the twin can tell the two plans apart."""
    mixer = _mixer(Q, seed=3)
    seqs = [{"len": sum(pieces), "donor": None, "at": 0, "pieces": pieces}]
    with torch.no_grad(), batch_invariant_mode():
        rows, good = _run(mixer, Q, seqs, _Fixed())
        _, bad = _run(mixer, Q, seqs, _Fixed(), mode="resume", reference=False)
        want = _unsplit(mixer, Q, rows[0])
    assert torch.equal(good[0], want)
    assert not torch.equal(bad[0], want), "the control plan gave the unsplit bits: the twin cannot see the chunking"
    first = pieces[0]
    assert torch.equal(bad[0][:first], want[:first])          # the first step is the same in both plans


def test_control_plan_equals_unsplit_where_every_split_is_a_boundary():
    """The control is a fair one: with every split a multiple of Q the two plans agree (the state
    after a complete chunk is the boundary state), so what differs above is the mid-chunk split."""
    Q = 4
    mixer = _mixer(Q, seed=5)
    seqs = [{"len": 12, "donor": None, "at": 0, "pieces": [4, 8]}]
    with torch.no_grad(), batch_invariant_mode():
        rows, bad = _run(mixer, Q, seqs, _Fixed(), mode="resume", reference=False)
        assert torch.equal(bad[0], _unsplit(mixer, Q, rows[0]))
