"""The `mamba2` fix's engine patch (fixtures/vllm/mamba2_patch.py) on the CPU, with fakes of the
vLLM 0.26 classes it touches and the CPU twins as kernels: design docs/design/mamba2-and-fp8.md
§B.2, §B.3, step E.4. **Not yet run on a GPU**: what only a GPU run confirms is listed in
docs/vllm-fixes.md (`mamba2`).

The fakes mimic vLLM exactly as far as the patch touches it, and no further:
- `mamba_mixer2`: `MambaMixer2` (the attributes `conv_ssm_forward` reads: widths, `A`, `D`,
  `dt_bias`, `conv_weights`, `conv1d.bias`, `kv_cache`, `cache_config`, `prefix`,
  `split_hidden_states_B_C_fn`), `get_forward_context`, `is_conv_state_dim_first` (False: the
  conv state stored (slots, K-1, dim), read through a transpose, as stock), `causal_conv1d_fn` /
  `causal_conv1d_update` (a CPU conv with their arguments and conv-state updates), and
  `mamba_chunk_scan_combined_varlen` (fixtures/vllm/mamba_scan_twin.py);
- `mamba2_attn`: the backend (batch invariance inherited False, as 0.26's), the metadata dataclass
  and a builder whose `build` makes the fields `_compute_common_metadata` makes in "none" mode
  (the 1-token prefill with prior state re-labelled a decode, decodes first, state indices from
  the block table) and whose `update_block_table` is inherited, as vLLM's;
- `selector`: `_cached_get_mamba_attn_backend`, cached, refusing as vLLM's does.

Checked: a multi-step schedule through the patched mixer (two layers; chunked prefill pieces
that split chunks anywhere, 1-token prefills re-labelled decodes, decode steps, requests joining
and leaving, a slot reused by a new request) gives every token the bits of one unsplit call per
sequence, with both conv paths; undo restores every attribute; each refusal is one line; planted
faults (a reused slot's stale state read, the driver state keyed by batch position) are red.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, note, settings, strategies as st

from fixtures.vllm import fixes as FX
from fixtures.vllm import mamba2_patch as MP
from fixtures.vllm.mamba_scan_twin import scan_twin

H, P, N, G, K = 4, 2, 4, 2, 4          # heads, head dim, state, groups, conv width
D_INNER, CONV_DIM = H * P, H * P + 2 * G * N
WIDTH = D_INNER + CONV_DIM + H          # in_proj's output: gate, xBC, dt
SLOTS = 8                               # the mamba cache's slots (0 is vLLM's null block, never given out)
BF = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# fake vLLM: mamba_mixer2
# ---------------------------------------------------------------------------------------------
def _conv_rows(window: torch.Tensor, weight, bias, L: int) -> torch.Tensor:
    """silu(bias + sum_j window[:, t + j] * w[:, j]) for t < L, elementwise in float64 (so a token's
    value does not depend on how many share the call), as vLLM's two conv kernels share one
    per-token expression (design §A.5)."""
    acc = bias.double()[:, None].expand(-1, L).clone()
    for j in range(weight.shape[1]):
        acc = acc + window[:, j:j + L].double() * weight[:, j:j + 1].double()
    return acc / (1 + torch.exp(-acc))


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                     activation="silu", block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None,
                     initial_state_idx=None, num_computed_tokens=None, block_size_to_align=0, metadata=None,
                     **_):
    """x (dim, T); conv_states (slots, dim, K-1); per sequence: the slot's state as the K-1 previous
    inputs where has_initial_state, else zeros; the slot's state becomes the last K-1 inputs."""
    assert activation == "silu" and block_idx_first_scheduled_token is None and num_computed_tokens is None
    W = weight.shape[1] - 1
    out = torch.empty(x.shape, dtype=torch.float64)
    qsl = [int(v) for v in query_start_loc]
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        s = int(cache_indices[i])
        prev = conv_states[s].clone() if bool(has_initial_state[i]) else torch.zeros_like(conv_states[s])
        window = torch.cat([prev, x[:, a:b].to(conv_states.dtype)], dim=1)
        out[:, a:b] = _conv_rows(window, weight, bias, b - a)
        conv_states[s] = window[:, -W:]
    return out.to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, **_):
    """x (batch, dim), one token per decode; the slot's state shifts left by one."""
    assert num_accepted_tokens is None and query_start_loc is None and max_query_len == 1
    W = weight.shape[1] - 1
    out = torch.empty(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        s = int(conv_state_indices[r, 0])
        window = torch.cat([conv_state[s].clone(), x[r, :, None].to(conv_state.dtype)], dim=1)
        out[r] = _conv_rows(window, weight, bias, 1)[:, 0]
        conv_state[s] = window[:, -W:]
    return out.to(x.dtype)


class MambaMixer2:
    """As vLLM's MambaMixer2 as far as conv_ssm_forward reads it (tensor parallel 1)."""

    def __init__(self, prefix: str, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.prefix, self.tp_size, self.activation = prefix, 1, "silu"
        self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups = H, P, N, G
        self.tped_intermediate_size, self.tped_conv_size, self.tped_dt_size = D_INNER, CONV_DIM, H
        self.conv_weights = (torch.randn(CONV_DIM, K, generator=g) * 0.5).to(BF)
        self.conv1d = SimpleNamespace(bias=(torch.randn(CONV_DIM, generator=g) * 0.1).to(BF))
        self.A = -torch.exp(torch.randn(H, generator=g) * 0.5)          # as loaded: -exp(A_log), fp32
        self.D, self.dt_bias = torch.randn(H, generator=g).to(BF), (torch.randn(H, generator=g) * 0.5).to(BF)
        self.cache_config = SimpleNamespace(mamba_block_size=16, mamba_cache_mode="none")
        self.kv_cache = (torch.zeros(SLOTS, K - 1, CONV_DIM, dtype=BF),   # (conv, ssm); the patch leaves ssm alone
                         torch.zeros(SLOTS, H, P, N, dtype=BF))
        self.split_hidden_states_B_C_fn = lambda t: torch.split(t, [D_INNER, G * N, G * N], dim=-1)

    def twin(self, prefix: str) -> "MambaMixer2":
        """The same weights, fresh caches, another name (its own replay state)."""
        other = MambaMixer2.__new__(MambaMixer2)
        other.__dict__.update(self.__dict__)
        other.prefix = prefix
        other.kv_cache = tuple(torch.zeros_like(t) for t in self.kv_cache)
        return other

    def conv_ssm_forward(self, projected_states, output):          # stands for stock: only the profile run gets here
        STOCK_CALLS.append(self.prefix)


STOCK_CALLS: list = []
FORWARD = SimpleNamespace(attn_metadata=None)


def _mixer_module():
    m = types.ModuleType(MP.MIXER_MODULE)
    m.MambaMixer2 = MambaMixer2
    m.get_forward_context = lambda: FORWARD
    m.is_conv_state_dim_first = lambda: False
    m.causal_conv1d_fn, m.causal_conv1d_update = causal_conv1d_fn, causal_conv1d_update
    m.mamba_chunk_scan_combined_varlen = scan_twin
    return m


# ---------------------------------------------------------------------------------------------
# fake vLLM: mamba2_attn and the selector
# ---------------------------------------------------------------------------------------------
def _backend_module():
    m = types.ModuleType(MP.BACKEND_MODULE)

    class AttentionBackend:
        @classmethod
        def supports_batch_invariance(cls):
            return False

    class Mamba2AttentionBackend(AttentionBackend):
        @staticmethod
        def get_name():
            return "MAMBA2_ATTN"

    @dataclasses.dataclass
    class Mamba2AttentionMetadata:
        num_prefills: int
        num_prefill_tokens: int
        num_decodes: int
        num_decode_tokens: int
        num_reqs: int
        has_initial_states_p: torch.Tensor | None
        query_start_loc_p: torch.Tensor | None
        state_indices_tensor_p: torch.Tensor | None
        state_indices_tensor_d: torch.Tensor | None
        chunk_size: int = 0

    class BaseMambaAttentionMetadataBuilder:
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.vllm_config, self.device = vllm_config, device

        def update_block_table(self, metadata, blk_table, slot_mapping):
            nd = metadata.num_decodes
            return dataclasses.replace(metadata, state_indices_tensor_d=blk_table[:nd, :1],
                                       state_indices_tensor_p=blk_table[nd:metadata.num_reqs, 0])

    class Mamba2AttentionMetadataBuilder(BaseMambaAttentionMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.chunk_size = vllm_config.model_config.get_mamba_chunk_size()

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
            m = common_attn_metadata
            B = m.num_reqs
            qlen = torch.diff(m.query_start_loc_cpu)[:B]
            prefilling = m.is_prefilling.clone()
            prefilling[(qlen == 1) & (m.seq_lens_cpu_upper_bound[:B] > 1)] = False     # re-labelled decodes
            nd = int((~prefilling).sum())
            assert not prefilling[:nd].any(), "the batch must be reordered: decodes first"
            nd_tok = int(qlen[:nd].sum())
            table = m.block_table_tensor[:B]
            npf = B - nd
            computed = m.seq_lens[:B] - qlen
            return Mamba2AttentionMetadata(
                npf, int(qlen[nd:].sum()), nd, nd_tok, B, (computed[nd:] > 0) if npf else None,
                (m.query_start_loc[nd:B + 1] - nd_tok) if npf else None, table[nd:, 0] if npf else None,
                table[:nd, :1] if nd else None, chunk_size=self.chunk_size)

    m.Mamba2AttentionBackend, m.Mamba2AttentionMetadata = Mamba2AttentionBackend, Mamba2AttentionMetadata
    m.Mamba2AttentionMetadataBuilder = Mamba2AttentionMetadataBuilder
    return m


def _selector_module(backend_module):
    m = types.ModuleType(MP.SELECTOR_MODULE)

    @functools.cache
    def _cached_get_mamba_attn_backend(mamba_type):
        cls = backend_module.Mamba2AttentionBackend
        if not cls.supports_batch_invariance():
            raise RuntimeError(f"VLLM batch_invariant mode is not supported for {cls.get_name()}.")
        return cls
    m._cached_get_mamba_attn_backend = _cached_get_mamba_attn_backend
    return m


class CGMode:
    def __init__(self, name):
        self.name = name

    def has_full_cudagraphs(self):
        return "FULL" in self.name


def _vllm_config(Q, *, mode="none", tp=1, spec=None, cudagraph="NONE"):
    return SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp), speculative_config=spec,
                           num_speculative_tokens=0 if spec is None else 2,
                           compilation_config=SimpleNamespace(cudagraph_mode=CGMode(cudagraph)),
                           model_config=SimpleNamespace(get_mamba_chunk_size=lambda: Q))


@pytest.fixture
def fake_vllm():
    mods = {"mixer": _mixer_module(), "backend": _backend_module()}
    mods["selector"] = _selector_module(mods["backend"])
    STOCK_CALLS.clear()
    FORWARD.attn_metadata = None
    yield mods
    FORWARD.attn_metadata = None


@pytest.fixture
def patched(fake_vllm):
    undo = MP.install(modules=fake_vllm)
    yield fake_vllm
    undo()


# ---------------------------------------------------------------------------------------------
# a fake engine: steps of (sequence, new tokens) through the builder and the mixers
# ---------------------------------------------------------------------------------------------
def _rows(length: int, seed: int) -> torch.Tensor:
    """in_proj's output for one sequence [L, WIDTH], bf16; dt kept moderate."""
    g = torch.Generator().manual_seed(1000 + seed)
    r = torch.randn(length, WIDTH, generator=g)
    r[:, D_INNER + CONV_DIM:] *= 0.5
    return r.to(BF)


def run_engine(mods, Q, layers, rows, steps, slots, conv_layer_rows=None) -> list[list[torch.Tensor]]:
    """Each step: the builder's metadata for the step's requests (decodes first, as vLLM reorders),
    then every layer's conv_ssm_forward; returns per layer per sequence its output rows in order.
    `slots[j]`: sequence j's cache slot (a finished sequence's slot may be given to a later one)."""
    builder = mods["backend"].Mamba2AttentionMetadataBuilder(None, [l.prefix for l in layers], _vllm_config(Q), "cpu")
    pos = [0] * len(rows[0])
    outs = [[[] for _ in rows[0]] for _ in layers]
    for step in steps:
        if not step:                    # a step that schedules none of these requests: vLLM builds no metadata
            continue
        decodes = [(j, n) for j, n in step if n == 1 and pos[j] > 0]
        order = decodes + [(j, n) for j, n in step if not (n == 1 and pos[j] > 0)]
        lens = [n for _, n in order]
        qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens = torch.tensor([pos[j] + n for j, n in order], dtype=torch.int32)
        cm = SimpleNamespace(num_reqs=len(order), query_start_loc_cpu=qsl, query_start_loc=qsl.clone(),
                             seq_lens_cpu_upper_bound=seq_lens, seq_lens=seq_lens.clone(),
                             is_prefilling=torch.tensor([True] * len(order), dtype=torch.bool),
                             block_table_tensor=torch.tensor([[slots[j]] for j, _ in order], dtype=torch.int32))
        md = builder.build(common_prefix_len=0, common_attn_metadata=cm)      # as vLLM's runner calls it
        FORWARD.attn_metadata = {l.prefix: md for l in layers}
        for li, layer in enumerate(layers):
            proj = torch.cat([rows[li][j][pos[j]:pos[j] + n] for j, n in order])
            out = torch.full((proj.shape[0], D_INNER), float("nan"), dtype=BF)
            layer.conv_ssm_forward(projected_states=proj, output=out)      # as vLLM's custom op calls it
            for (j, _), part in zip(order, out.split(lens)):
                outs[li][j].append(part)
        for j, n in order:
            pos[j] += n
    FORWARD.attn_metadata = None
    return [[torch.cat(o) for o in per_layer] for per_layer in outs]


def differences(mods, Q, lengths, steps, slots, seed=0) -> list[str]:
    """What differs between the schedule through the patched mixers and one unsplit call per
    sequence (each alone, one prefill from position 0, in a fresh layer of the same weights)."""
    layers = [MambaMixer2(f"model.layers.{i}.mixer", seed=50 * seed + i) for i in range(2)]
    rows = [[_rows(L, 100 * seed + 10 * i + j) for j, L in enumerate(lengths)] for i in range(len(layers))]
    got = run_engine(mods, Q, layers, rows, steps, slots)
    bad = []
    for j, L in enumerate(lengths):
        refs = [l.twin(f"unsplit.{j}.{l.prefix}") for l in layers]
        want = run_engine(mods, Q, refs, [[r[j]] for r in rows], [[(0, L)]], [1])
        for li in range(len(layers)):
            a, b = got[li][j], want[li][0]
            if not torch.equal(a, b):
                where = (a != b).any(1).nonzero().flatten().tolist()
                bad.append(f"layer {li} seq {j} (L={L}, slot {slots[j]}): rows {where[:6]} differ from unsplit")
    return bad


Q8 = 8
# seq 0 and 1 prefill in pieces that split chunks mid-way (3, 6, ...), a 1-token prefill with prior
# state (re-labelled a decode), decode steps mixed with prefills; seq 2 joins after seq 0 has left
# and takes its slot (3); seq 3 joins late in a fresh slot
LENGTHS = (21, 19, 13, 6)
SLOTS_OF = (3, 5, 3, 6)
STEPS = [[(0, 3)], [(0, 6), (1, 5)], [(0, 1), (1, 1)], [(0, 9), (1, 7)], [(0, 1), (1, 1)], [(0, 1), (1, 1), (3, 2)],
         [(1, 1), (3, 4)], [(2, 5), (1, 3)], [(2, 1)], [(2, 7)]]


@pytest.mark.parametrize("conv", MP.CONV_PATHS)
def test_schedule_through_the_patched_mixer_gives_the_unsplit_bits(fake_vllm, conv):
    """Chunked prefill pieces, decodes, joins and leaves, a reused slot: every token's output in
    both layers equals its row of one unsplit call per sequence, bit for bit."""
    assert sum(n for s in STEPS for j, n in s if j == 0) == LENGTHS[0]
    assert all(sum(n for s in STEPS for j, n in s if j == q) == L for q, L in enumerate(LENGTHS))
    undo = MP.install(modules=fake_vllm, conv=conv)
    try:
        with torch.no_grad():
            bad = differences(fake_vllm, Q8, LENGTHS, STEPS, SLOTS_OF)
        state = MP.installed_patch().states
        assert set(state) >= {"model.layers.0.mixer", "model.layers.1.mixer"}       # one state per layer
        assert state["model.layers.0.mixer"][0].dtype == torch.float32 and state["model.layers.0.mixer"][0].shape[0] == SLOTS
    finally:
        undo()
    assert not bad, "\n".join(bad)


@st.composite
def schedules(draw):
    """Q, 2-3 sequences, and engine steps: each sequence's prefill pieces of drawn sizes then decode
    steps, a drawn subset of the ready sequences per step; one later sequence reuses the slot of
    one that finished, if any did."""
    Q = draw(st.sampled_from([4, 8]), label="Q")
    lengths = draw(st.lists(st.integers(1, 3 * Q + 2), min_size=2, max_size=3), label="lengths")
    pieces = []
    for j, L in enumerate(lengths):
        prefill = draw(st.integers(1, L), label=f"seq {j} prefill")
        sizes, left = [], prefill
        while left:
            sizes.append(draw(st.integers(1, min(left, 2 * Q + 1)), label=f"seq {j} piece"))
            left -= sizes[-1]
        pieces.append(sizes + [1] * (L - prefill))
    steps, todo, start = [], [list(p) for p in pieces], draw(st.integers(0, 2), label="late starter's delay")
    done_at = {}
    while any(todo):
        ready = [j for j, t in enumerate(todo) if t and (j < len(todo) - 1 or len(steps) >= start)]
        pick = draw(st.lists(st.sampled_from(ready), min_size=1, unique=True), label="step") if len(ready) > 1 else ready
        steps.append([(j, todo[j].pop(0)) for j in sorted(pick)])
        for j in pick:
            if not todo[j]:
                done_at.setdefault(j, len(steps))
    slots = list(range(2, 2 + len(lengths)))
    last = len(lengths) - 1
    first_step_of_last = next(i for i, s in enumerate(steps) if any(j == last for j, _ in s))
    freed = [j for j, at in done_at.items() if j != last and at <= first_step_of_last]
    if freed:
        slots[last] = slots[freed[0]]          # a new request in a slot a finished one left
    return Q, lengths, steps, slots


@given(sched=schedules(), seed=st.integers(0, 2))
@settings(max_examples=12, deadline=None)
def test_drawn_schedules_give_the_unsplit_bits(sched, seed):
    Q, lengths, steps, slots = sched
    note(f"Q={Q} lengths={lengths} slots={slots} steps={steps}")
    mods = {"mixer": _mixer_module(), "backend": _backend_module()}
    undo = MP.install(modules=mods)
    try:
        with torch.no_grad():
            bad = differences(mods, Q, lengths, steps, slots, seed)
    finally:
        undo()
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# planted faults: each must be seen
# ---------------------------------------------------------------------------------------------
def test_planted_reused_slot_stale_state_is_red(patched, monkeypatch):
    """The fresh-request mask dropped (a slot's boundary state read although the request starts at
    0): the request that reuses seq 0's slot starts from seq 0's state, so it differs; the others
    (fresh slots hold zeros) do not."""
    real = MP.slot_index

    def stale(p, slots):
        idx = real(p, slots)
        return dataclasses.replace(idx, has_initial_state=torch.ones_like(idx.has_initial_state))
    monkeypatch.setattr(MP, "slot_index", stale)
    with torch.no_grad():
        bad = differences(patched, Q8, LENGTHS, STEPS, SLOTS_OF)
    assert bad and all(" seq 2 " in b for b in bad), bad


def test_planted_state_keyed_by_batch_position_is_red(patched, monkeypatch):
    """The driver's state keyed by the request's place in the batch instead of its state index:
    requests joining and leaving move places, so tokens differ."""
    monkeypatch.setattr(MP, "slots_of", lambda md, n: torch.arange(1, n + 1, dtype=torch.int64))
    with torch.no_grad():
        bad = differences(patched, Q8, LENGTHS, STEPS, SLOTS_OF)
    assert bad


def test_planted_partial_chunk_state_written_is_red(patched, monkeypatch):
    """The stock bug (design §B.3 step 6): the boundary state moved to a partial chunk's end state."""
    real_plan = MP.plan

    def partial(num_computed, query_lens, chunk_size):
        p = real_plan(num_computed, query_lens, chunk_size)
        return dataclasses.replace(p, state_chunk=tuple(p.last_chunk_indices))
    monkeypatch.setattr(MP, "plan", partial)
    with torch.no_grad():
        bad = differences(patched, Q8, LENGTHS, STEPS, SLOTS_OF)
    assert bad


# ---------------------------------------------------------------------------------------------
# install / undo, the selector, the profile run, refusals
# ---------------------------------------------------------------------------------------------
def _class_dicts(mods):
    b = mods["backend"]
    return {cls: dict(vars(cls)) for cls in (mods["mixer"].MambaMixer2, b.Mamba2AttentionBackend,
                                              b.Mamba2AttentionMetadataBuilder)}


def test_undo_restores_every_patched_attribute(fake_vllm):
    before = _class_dicts(fake_vllm)
    select = fake_vllm["selector"]._cached_get_mamba_attn_backend
    with pytest.raises(RuntimeError, match="not supported for MAMBA2_ATTN"):
        select("MAMBA2")
    undo = MP.install(modules=fake_vllm)
    B = fake_vllm["backend"]
    assert B.Mamba2AttentionBackend.supports_batch_invariance() is True
    assert select("MAMBA2") is B.Mamba2AttentionBackend             # the refusal lifted while installed
    assert "update_block_table" in vars(B.Mamba2AttentionMetadataBuilder)
    assert MP.is_patched(B.Mamba2AttentionBackend.supports_batch_invariance)
    with pytest.raises(RuntimeError, match="already installed"):
        MP.install(modules=fake_vllm)
    undo()
    after = _class_dicts(fake_vllm)
    for cls, d in before.items():
        assert set(after[cls]) == set(d), (cls, set(after[cls]) ^ set(d))
        assert all(after[cls][k] is v for k, v in d.items() if k != "__dict__" and k != "__weakref__"), cls
    assert B.Mamba2AttentionBackend.supports_batch_invariance() is False
    with pytest.raises(RuntimeError, match="not supported for MAMBA2_ATTN"):      # the cached choice was cleared
        select("MAMBA2")
    assert MP.installed_patch() is None


def test_profile_run_goes_to_stock_and_unplanned_metadata_is_refused(patched):
    """The profile run (no metadata) runs stock's method, then warms up the replay's scan variant
    once per layer; metadata without a plan is refused in one line, never served by stock."""
    layer = MambaMixer2("model.layers.0.mixer", seed=1)
    out = torch.zeros(3, D_INNER, dtype=BF)
    calls = []
    patched["mixer"].mamba_chunk_scan_combined_varlen = lambda *a, **k: calls.append(k) or scan_twin(*a, **k)
    layer.model_config = SimpleNamespace(get_mamba_chunk_size=lambda: Q8)
    layer.conv_ssm_forward(_rows(3, 0), out)                        # no metadata: vLLM's profile run
    layer.conv_ssm_forward(_rows(3, 0), out)
    assert STOCK_CALLS == ["model.layers.0.mixer"] * 2
    assert len(calls) == 1 and calls[0]["return_intermediate_states"] and calls[0]["state_dtype"] == torch.float32 \
        and calls[0]["initial_states"] is not None          # the replay's scan variant warmed up once per layer
    md = patched["backend"].Mamba2AttentionMetadata(0, 3, 0, 0, 1, None, None, None, None, chunk_size=Q8)
    FORWARD.attn_metadata = {layer.prefix: md}                      # as an unwrapped builder would make it
    with pytest.raises(RuntimeError) as err:
        layer.conv_ssm_forward(_rows(3, 0), out)
    assert str(err.value).startswith("mamba2: ") and "no replay plan" in str(err.value) and "\n" not in str(err.value)


def test_update_block_table_keeps_the_plan_with_the_new_slots(patched):
    """A second KV-cache group's metadata (update_block_table): the same plan, its own state
    indices, so its slot index is made afresh."""
    B = patched["backend"]
    builder = B.Mamba2AttentionMetadataBuilder(None, ["a"], _vllm_config(Q8), "cpu")
    qsl = torch.tensor([0, 1, 6], dtype=torch.int32)
    seq_lens = torch.tensor([9, 5], dtype=torch.int32)
    cm = SimpleNamespace(num_reqs=2, query_start_loc_cpu=qsl, query_start_loc=qsl.clone(), seq_lens_cpu_upper_bound=seq_lens,
                         seq_lens=seq_lens.clone(), is_prefilling=torch.tensor([False, True]),
                         block_table_tensor=torch.tensor([[4], [2]], dtype=torch.int32))
    md = builder.build(0, cm)
    step = getattr(md, MP.STEP_ATTR)
    assert step.plan.num_computed == (8, 0) and step.plan.query_lens == (1, 5)
    other = builder.update_block_table(md, torch.tensor([[6], [7]], dtype=torch.int32), None)
    assert getattr(other, MP.STEP_ATTR) is step
    assert MP.slots_of(other, 2).tolist() == [6, 7] and MP.slots_of(md, 2).tolist() == [4, 2]


@pytest.mark.parametrize("config,what", [
    (dict(mode="all"), "mamba_cache_mode='all'"), (dict(mode="align"), "mamba_cache_mode='align'"),
    (dict(tp=2), "tensor_parallel_size=2"), (dict(spec={"method": "mtp"}), "speculative decoding"),
    (dict(cudagraph="FULL_AND_PIECEWISE"), "FULL_AND_PIECEWISE"), (dict(cudagraph="FULL_DECODE_ONLY"), "FULL graphs")])
def test_each_refusal_is_one_line(patched, config, what):
    with pytest.raises(RuntimeError) as err:
        patched["backend"].Mamba2AttentionMetadataBuilder(None, ["a"], _vllm_config(Q8, **config), "cpu")
    msg = str(err.value)
    assert msg.startswith("mamba2: ") and what in msg and "\n" not in msg, msg


@pytest.mark.parametrize("cudagraph", ["NONE", "PIECEWISE"])
def test_served_configurations_are_not_refused(patched, cudagraph):
    assert MP.refusal(_vllm_config(Q8, cudagraph=cudagraph)) is None
    MP.check_engine_kwargs({"enforce_eager": True, "enable_prefix_caching": False})
    MP.check_engine_kwargs({"compilation_config": {"cudagraph_mode": cudagraph}})


@pytest.mark.parametrize("kwargs,what", [
    ({"enable_prefix_caching": True}, "prefix caching"), ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"speculative_config": {"method": "ngram"}}, "speculative decoding"),
    ({"compilation_config": {"cudagraph_mode": "FULL"}}, "FULL graphs")])
def test_engine_kwargs_refusals_are_one_line(kwargs, what):
    with pytest.raises(RuntimeError) as err:
        MP.check_engine_kwargs(kwargs)
    assert str(err.value).startswith("mamba2: ") and what in str(err.value) and "\n" not in str(err.value)


def test_the_fix_pack_installs_the_patch_on_vllm_module_paths(fake_vllm, monkeypatch):
    """fixes.install(("mamba2",)) with VLLM_BATCH_INVARIANT=1 reaches the patch through vLLM's module
    paths (here the fakes, injected in sys.modules); needed() still says needed while only the
    patch declares invariance; activate(()) undoes it."""
    for path, mod in ((MP.MIXER_MODULE, fake_vllm["mixer"]), (MP.BACKEND_MODULE, fake_vllm["backend"]),
                      (MP.SELECTOR_MODULE, fake_vllm["selector"])):
        parts = path.split(".")
        for i in range(1, len(parts)):
            name = ".".join(parts[:i])
            if not isinstance(sys.modules.get(name), types.ModuleType) or name == "vllm":
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, path, mod)
    for path in (MP.MIXER_MODULE, MP.BACKEND_MODULE, MP.SELECTOR_MODULE):
        parent, child = path.rsplit(".", 1)
        monkeypatch.setattr(sys.modules[parent], child, sys.modules[path], raising=False)
    monkeypatch.setattr(FX, "_ACTIVE", {})
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    before = _class_dicts(fake_vllm)
    report = FX.install(("mamba2",), where="engine")
    assert report["mamba2"].startswith("installed"), report
    backend = fake_vllm["backend"].Mamba2AttentionBackend
    assert backend.supports_batch_invariance() is True
    need, why = FX.FIXES["mamba2"].needed()
    assert need is True and "mamba2 patch" in why
    FX.activate(())
    assert backend.supports_batch_invariance() is False and FX.installed() == ()
    assert {c: set(d) for c, d in _class_dicts(fake_vllm).items()} == {c: set(d) for c, d in before.items()}
