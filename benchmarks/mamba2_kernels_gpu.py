"""Row invariance of vLLM 0.26's own Mamba-2 and FP8 kernels, called directly (no engine): the GPU
check that docs/design/mamba2-and-fp8.md section E starts with (steps E.1 and E.2, FP8 F1 and F3).

Every probe is bitwise (the bits of each element, no tolerance) and independent: one that raises is
recorded as `error: <one line>` and the others go on. Widths are Nemotron-H's Mamba-2 mixer
(nheads 128, headdim 64, d_state 128, ngroups 8, conv width 4), bf16 inputs, fp32 SSM state.

- ssd_prefix (E.1 ii): `mamba_chunk_scan_combined_varlen` over the first L' tokens of a sequence
  alone = the first L' rows of the same call over all L tokens (a partial chunk is a prefix of
  the full chunk), with a zero and with an fp32 initial state; the final state alone = the full
  run's intermediate state where L' is a multiple of the chunk size.
- ssd_packed (E.1 i): several sequences packed in one varlen call = each alone (outputs and final
  states); packed in the reverse order; a zero initial state passed as a tensor = None.
- ssd_rerun (E.1 v): the same call twice in this process.
- replay (E.3, C.2 iv): the replay driver (fixtures/vllm/mamba_replay_driver.py, design B.3) with
  this kernel: sequences fed in engine steps (a fixed schedule with splits = Q-1, 1, 0 mod Q and
  decodes across a boundary, then `--replay-schedules` seeded drawn ones: prefill pieces of drawn
  sizes, decode steps of 1, drawn requests per step, drawn cache slots) = one unsplit call per
  sequence from a zero fp32 state (every token's output, stored fp32; the fp32 boundary state after every
  step = the unsplit call's state at that boundary); the stock mid-chunk continuation (a logical
  chunk from the cut, the fp32 state after the last token) as the control that must differ.
- ssd_two_process (E.1 v): the same call in a subprocess of this script (`--child`), which
  autotunes the SSD kernels afresh; the autotuner's choices of both processes are recorded.
- conv (E.2): `causal_conv1d_update` token by token = `causal_conv1d_fn` over the sequence from the
  same initial conv state (each token's output and the final conv state); fn packed = alone; fn
  over a sequence split in two with the conv state carried = unsplit.
- ssu (E.2 control, C.3): `selective_state_update` decode steps vs the chunk scan's rows for the
  same tokens from the same boundary state (expected to differ: a finding, not an error); and
  its rows at batch 1..256 vs the largest batch.
- fp8_linear (F1): `scaled_fp8_quant` (per-token dynamic, as Fp8PerTensorOnlineLinearMethod on a
  CUTLASS-capable card) + `cutlass_scaled_mm` (CutlassFP8ScaledMMLinearKernel's call) with a
  per-tensor FP8 weight, at M = 1..4096 for (N, K) = (4096, 4096), (12288, 4096): each row of an
  M-row call = that row of the largest call; the activation quantization's rows alone; a static
  per-tensor activation scale; a dynamic per-tensor scale as the control that must differ.
- fp8_moe (F3): `fused_experts` with fp8 w8a8 (per-expert per-tensor weight scales) at M = 1..1024,
  hidden 2048, intermediate 768, per `--moe` E x top_k: dynamic per-tensor activation scale
  (what the online FP8 MoE method uses), static per-tensor, dynamic per-token.

    python benchmarks/mamba2_kernels_gpu.py --json /tmp/res/mamba.json
    python benchmarks/mamba2_kernels_gpu.py --probes ssd_prefix,ssd_packed --chunk-sizes 128,256
    python benchmarks/mamba2_kernels_gpu.py --stock          # VLLM_BATCH_INVARIANT=0 instead of 1

VLLM_BATCH_INVARIANT=1 is set before vLLM is imported (as the suite runs the engine; it fixes the
fused-MoE Triton config), 0 with `--stock`; the table's header says which. The SSD kernels
autotune on first use, once per chunk size (tens of seconds each; the child of ssd_two_process
does it again). The probes run at the first chunk size in the order of `PROBES` (the two-process
one last), then ssd_prefix, ssd_packed, ssd_rerun, replay and ssu at the other chunk sizes; once
`--budget-s` seconds have passed (from the start, vLLM's import included) the remaining probes
are recorded as skipped. The JSON is rewritten after every probe, so a run cut short keeps what
it measured.

Not yet run on a GPU (written on a CPU-only machine from reading vLLM 0.26's source). Prints a
markdown table; exits 0 (variant rows are findings), 2 on bad arguments, 3 without CUDA or vLLM
(one line each). tests_meta/test_mamba2_kernels_benchmark.py runs the arguments, the exits and the
row comparison on the CPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NHEADS, HEADDIM, DSTATE, NGROUPS, CONV_WIDTH = 128, 64, 128, 8, 4     # Nemotron-H's mixer
CONV_DIM = NHEADS * HEADDIM + 2 * NGROUPS * DSTATE
PROBES = ("ssd_prefix", "ssd_packed", "ssd_rerun", "replay", "conv", "ssu", "fp8_linear", "fp8_moe", "ssd_two_process")
PER_CHUNK = ("ssd_prefix", "ssd_packed", "ssd_rerun", "replay", "ssu")   # also run for the other chunk sizes
FP8_SIZES = (1, 16, 17, 64, 65, 128, 129, 256, 1024, 4096)
FP8_SHAPES = ((4096, 4096), (12288, 4096))
MOE_SIZES = (1, 7, 64, 255, 256, 257, 1024)
MOE_HIDDEN, MOE_INTERMEDIATE = 2048, 768
MOE_A2_SCALE = 0.02     # the static intermediate scale: a guess at absmax / 448 (saturation is harmless here)
SSU_BATCHES = (1, 2, 8, 64, 256)
SSU_STEPS = 8
REPLAY_DECODE = 12      # decode steps per sequence at most, in the drawn replay schedules


class _Parser(argparse.ArgumentParser):
    def error(self, message):       # one line, not argparse's usage + message
        raise ValueError(message)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected whole numbers, comma-separated") from None
    if not vals:
        raise ValueError(f"{what}: expected at least one value")
    return vals


def parse_args(argv) -> argparse.Namespace:
    """The arguments, checked: ValueError (one line) on anything wrong."""
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="also write the results here (rewritten after every probe)")
    ap.add_argument("--probes", default="all", help=f"comma-separated, of: {', '.join(PROBES)} (default all)")
    ap.add_argument("--chunk-sizes", default="128,256",
                    help="SSD chunk sizes, powers of two (Nemotron-H 128, Mamba2 256); the first is the main one")
    ap.add_argument("--seed", type=int, default=0, help="the inputs' seed")
    ap.add_argument("--moe", default="8x2,64x8", help="fused-MoE experts x top_k, comma-separated")
    ap.add_argument("--replay-schedules", type=int, default=4,
                    help="drawn schedules of the replay probe per chunk size, besides its fixed one (0..100)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="start no probe after this many seconds (the rest are recorded as skipped)")
    ap.add_argument("--stock", action="store_true", help="VLLM_BATCH_INVARIANT=0 instead of 1")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)     # ssd_two_process's subprocess
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.probes.split(",") if p.strip()]
    if names == ["all"]:
        names = list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown or not names:
        raise ValueError(f"--probes: unknown {', '.join(unknown) or '(none given)'}; expected some of {', '.join(PROBES)}")
    args.probe_list = [p for p in PROBES if p in names]
    args.chunk_list = list(dict.fromkeys(_ints(args.chunk_sizes, "--chunk-sizes")))
    for q in args.chunk_list:
        if q < 16 or q > 4096 or q & (q - 1):
            raise ValueError(f"--chunk-sizes: {q} is not a power of two in 16..4096")
    args.moe_list = []
    for item in (t.strip() for t in args.moe.split(",") if t.strip()):
        try:
            e, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"--moe {item!r}: expected EXPERTSxTOPK, e.g. 64x8") from None
        if e < 2 or not 1 <= k <= e:
            raise ValueError(f"--moe {item!r}: expected at least 2 experts and 1 <= top_k <= experts")
        args.moe_list.append((e, k))
    if not args.moe_list:
        raise ValueError("--moe: expected at least one EXPERTSxTOPK")
    if not 0 <= args.replay_schedules <= 100:
        raise ValueError(f"--replay-schedules {args.replay_schedules}: expected 0..100")
    if not args.budget_s > 0:
        raise ValueError("--budget-s: expected a positive number of seconds")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise ValueError(f"--json {args.json}: its directory does not exist")
    return args


def gpu_missing() -> str | None:
    """Why nothing can be measured here, in one line; None on a machine with CUDA and vLLM."""
    import importlib.util
    import torch
    if not torch.cuda.is_available():
        return ("no CUDA device (torch.cuda.is_available() is False): this probe runs vLLM's kernels on a GPU; "
                "nothing measured")
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: this probe runs vLLM 0.26's kernels; nothing measured"
    return None


def set_environment(stock: bool) -> None:
    """Before vLLM is imported: batch-invariant mode as the suite runs the engine (or stock), and
    vLLM's log on stderr so stdout holds the table."""
    os.environ["VLLM_BATCH_INVARIANT"] = "0" if stock else "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


# ---------------------------------------------------------------------------------------------
# the row comparison (pure torch: tests_meta runs it on planted tensors)
# ---------------------------------------------------------------------------------------------
def row_diff(lhs, rhs) -> dict:
    """Bitwise comparison of two tensors of one shape and dtype, read as rows (the first
    dimension) of flattened columns: rows and elements differing, the first differing (row,
    column) with both values and their bits in hex, the largest ULP distance over the differing
    elements (float32 / bf16 / fp16; None for other dtypes), and the verdict word."""
    import torch
    from fixtures.core.comparison import INT_VIEW, ulp_distance
    if tuple(lhs.shape) != tuple(rhs.shape) or lhs.dtype != rhs.dtype:
        raise ValueError(f"cannot compare {tuple(lhs.shape)} {lhs.dtype} with {tuple(rhs.shape)} {rhs.dtype}")
    rows = lhs.shape[0] if lhs.dim() else 1
    a = lhs.detach().reshape(rows, -1).contiguous()
    b = rhs.detach().reshape(rows, -1).contiguous()
    width = lhs.element_size()
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    ai, bi = a.view(iv), b.view(iv)
    bad = ai != bi
    row_bad = bad.any(1)
    res = {"rows": rows, "cols": a.shape[1], "rows_differing": int(row_bad.sum()),
           "elements_differing": int(bad.sum()), "first": None, "lhs_value": None, "rhs_value": None,
           "lhs_hex": "", "rhs_hex": "", "max_ulp": None}
    if a.is_floating_point():
        res["nan"] = int(torch.isnan(a.float()).sum() + torch.isnan(b.float()).sum())
    if res["elements_differing"]:
        r = int(row_bad.nonzero()[0, 0])
        c = int(bad[r].nonzero()[0, 0])
        mask = (1 << (8 * width)) - 1
        res["first"] = [r, c]
        res["lhs_hex"] = f"0x{int(ai[r, c]) & mask:0{2 * width}x}"
        res["rhs_hex"] = f"0x{int(bi[r, c]) & mask:0{2 * width}x}"
        res["lhs_value"], res["rhs_value"] = float(a[r, c].float()), float(b[r, c].float())
        if lhs.dtype in INT_VIEW:
            res["max_ulp"] = int(ulp_distance(a[bad], b[bad]).max())
    res["verdict"] = "variant" if res["elements_differing"] else "invariant"
    return res


def _error(exc: BaseException) -> str:
    print(traceback.format_exc(), file=sys.stderr, flush=True)
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def case(cases: list, label: str, size, compute) -> None:
    """Append one comparison: compute() returns (lhs, rhs) for row_diff; an exception is recorded
    as this case's error and the probe goes on."""
    try:
        lhs, rhs = compute()
        cases.append({"case": label, "size": size, **row_diff(lhs, rhs)})
    except Exception as exc:
        cases.append({"case": label, "size": size, "error": _error(exc), "verdict": "error"})


def summarize(group: dict) -> dict:
    """One group's cases folded into its table row: verdict `variant` if any case differs, else
    `error` if the group or any case failed (or nothing ran), else `invariant`."""
    cases = group.get("cases", [])
    ok = [c for c in cases if "error" not in c]
    first = next((c for c in ok if c.get("first")), None)
    ulps = [c["max_ulp"] for c in ok if c.get("max_ulp") is not None]
    errors = ([group["error"]] if group.get("error") else []) + [f"{c['case']}: {c['error']}" for c in cases if "error" in c]
    if first is not None:
        verdict = "variant"
    elif errors or not ok:
        verdict = "error"
    else:
        verdict = "invariant"
    return {"rows": sum(c["rows"] for c in ok), "rows_differing": sum(c["rows_differing"] for c in ok),
            "cases_differing": sum(1 for c in ok if c.get("first")), "first": first,
            "max_ulp": max(ulps) if ulps else None, "errors": errors, "verdict": verdict}


def _sizes(cases: list) -> str:
    sizes = list(dict.fromkeys(str(c["size"]) for c in cases if c.get("size") is not None))
    return ",".join(sizes) if len(",".join(sizes)) <= 60 else ",".join(sizes[:8]) + f",... ({len(sizes)})"


def table(results: dict) -> str:
    """The markdown table (one row per probe group), then a line per differing case and error."""
    meta = results.get("meta", {})
    bi = meta.get("VLLM_BATCH_INVARIANT", "?")
    lines = [f"VLLM_BATCH_INVARIANT={bi}; vLLM {meta.get('vllm', '?')}, torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, {meta.get('device', '?')}; seed {meta.get('seed', '?')}", "",
             "| probe | group | shape | sizes tried | rows differing | first difference (case: row, col) | "
             "max ULP | verdict | expected |",
             "|---|---|---|---|---|---|---|---|---|"]
    details = []
    for p in results.get("probes", []):
        name = p["probe"] + (f" (Q={p['chunk_size']})" if p.get("chunk_size") else "")
        if p.get("skipped") or p.get("error"):
            word = "skipped" if p.get("skipped") else "error"
            lines.append(f"| {name} | - | - | - | - | {word}: {p.get('skipped') or p['error']} | - | {word} | - |")
            continue
        for g in p.get("groups", []):
            s = summarize(g)
            f = s["first"]
            first = [f"{f['case']}: row {f['first'][0]}, col {f['first'][1]}: {f['lhs_hex']} vs {f['rhs_hex']}"] if f else []
            if s["errors"]:
                first.append("error: " + s["errors"][0] +
                             (f" (+{len(s['errors']) - 1} more)" if len(s["errors"]) > 1 else ""))
            first = "; ".join(first) or "-"
            ulp = "-" if s["max_ulp"] is None else str(s["max_ulp"])
            lines.append(f"| {name} | {g['name']} | {g.get('shape', '-')} | {_sizes(g.get('cases', []))} | "
                         f"{s['rows_differing']:,} of {s['rows']:,} | {first} | {ulp} | {s['verdict']} | "
                         f"{g.get('expected', '-')} |")
            for c in g.get("cases", []):
                if c.get("first"):
                    details.append(f"{name} / {g['name']} / {c['case']}: {c['rows_differing']:,} of {c['rows']:,} rows "
                                   f"differ ({c['elements_differing']:,} elements); first at row {c['first'][0]}, "
                                   f"col {c['first'][1]}: {c['lhs_value']!r} ({c['lhs_hex']}) vs {c['rhs_value']!r} "
                                   f"({c['rhs_hex']}); max ULP {c['max_ulp']}")
                elif "error" in c:
                    details.append(f"{name} / {g['name']} / {c['case']}: error: {c['error']}")
                if c.get("nan"):
                    details.append(f"{name} / {g['name']} / {c['case']}: {c['nan']:,} NaN elements (unwritten rows?)")
            for k, v in g.get("notes", {}).items():
                details.append(f"{name} / {g['name']}: {k}: {v}")
    return "\n".join(lines + ([""] + details if details else []))


# ---------------------------------------------------------------------------------------------
# inputs (on the CPU from the seed, so a second process draws the same bits)
# ---------------------------------------------------------------------------------------------
def _gen(seed: int, *tag: int):
    import torch
    s = seed
    for t in tag:
        s = s * 1_000_003 + t
    return torch.Generator().manual_seed(s & 0x7FFFFFFF)


def ssd_params(seed: int, dev) -> dict:
    """A (fp32, -[1, 16]), D and dt_bias (bf16: created under the model dtype, inferred), as a
    Mamba-2 mixer holds them after loading."""
    import torch
    g = _gen(seed, 1)
    A = -torch.exp(torch.rand(NHEADS, generator=g, dtype=torch.float64) * math.log(16)).float()
    D = (torch.rand(NHEADS, generator=g) + 0.5).to(torch.bfloat16)
    dt0 = torch.exp(torch.rand(NHEADS, generator=g, dtype=torch.float64) * (math.log(0.1) - math.log(1e-3))
                    + math.log(1e-3))
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(torch.bfloat16)      # softplus^-1(dt0)
    return {"A": A.to(dev), "D": D.to(dev), "dt_bias": dt_bias.to(dev)}


def ssd_sequence(seed: int, tag: int, length: int, dev) -> dict:
    """One sequence's mixer inputs after the conv: x (L, H, P), raw dt (L, H), B and C (L, G, N), bf16."""
    import torch
    g = _gen(seed, 2, tag)
    bf = torch.bfloat16
    return {"x": torch.randn(length, NHEADS, HEADDIM, generator=g).to(bf).to(dev),
            "dt": (torch.randn(length, NHEADS, generator=g) * 0.5).to(bf).to(dev),
            "B": torch.randn(length, NGROUPS, DSTATE, generator=g).to(bf).to(dev),
            "C": torch.randn(length, NGROUPS, DSTATE, generator=g).to(bf).to(dev)}


def ssd_state(seed: int, tag: int, n: int, dev):
    import torch
    return (torch.randn(n, NHEADS, HEADDIM, DSTATE, generator=_gen(seed, 3, tag)) * 0.1).to(dev)


def _prefix(seq: dict, n: int) -> dict:
    return {k: v[:n] for k, v in seq.items()}


def scan(seqs: list, params: dict, Q: int, inits=None, intermediate: bool = False, out_dtype=None):
    """vLLM's mamba_chunk_scan_combined_varlen over the sequences packed, each from position 0,
    as MambaMixer2.conv_ssm_forward calls it (dt_softplus, dt_limit (0, inf), fp32 state). The
    chunk metadata is the builder's for requests with nothing computed
    (fixtures.vllm.mamba_replay_plan.plan). Returns (out [T, H, P] in out_dtype, default x's, states)."""
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from fixtures.vllm.mamba_replay_plan import plan
    dev = params["A"].device
    lens = [s["x"].shape[0] for s in seqs]
    t = plan([0] * len(lens), lens, Q).tensors(dev)
    x, dt, B, C = (torch.cat([s[k] for s in seqs]) for k in ("x", "dt", "B", "C"))
    out = torch.full_like(x, float("nan"), dtype=out_dtype)
    states = mamba_chunk_scan_combined_varlen(
        x, dt, params["A"], B, C, chunk_size=Q, cu_seqlens=t["cu_seqlens"],
        cu_chunk_seqlens=t["cu_chunk_seqlens"], last_chunk_indices=t["last_chunk_indices"],
        seq_idx=t["seq_idx"], out=out, D=params["D"], z=None, dt_bias=params["dt_bias"],
        initial_states=inits, dt_softplus=True, dt_limit=(0.0, float("inf")),
        return_intermediate_states=intermediate, state_dtype=torch.float32)
    return out, states


def autotune_choices() -> dict:
    """The config each SSD kernel's Triton autotuner chose, per key (empty before first use)."""
    from vllm.model_executor.layers.mamba.ops import ssd_bmm, ssd_chunk_scan, ssd_chunk_state, ssd_state_passing
    kernels = {"bmm_chunk": ssd_bmm._bmm_chunk_fwd_kernel, "chunk_scan": ssd_chunk_scan._chunk_scan_fwd_kernel,
               "chunk_cumsum": ssd_chunk_state._chunk_cumsum_fwd_kernel,
               "chunk_state": ssd_chunk_state._chunk_state_fwd_kernel,
               "state_passing": ssd_state_passing._state_passing_fwd_kernel}
    return {n: {str(k): str(c) for k, c in (getattr(kern, "cache", None) or {}).items()} for n, kern in kernels.items()}


# ---------------------------------------------------------------------------------------------
# the probes (GPU): each returns a list of groups {name, shape, expected, cases, notes}
# ---------------------------------------------------------------------------------------------
SHAPE_SSD = f"H={NHEADS} P={HEADDIM} N={DSTATE} G={NGROUPS}"


def probe_ssd_prefix(ctx, Q: int) -> list:
    L = 2 * Q + 44
    prefixes = sorted({1, 37, Q - 1, Q, Q + 1, Q + 72, 2 * Q - 1, 2 * Q} & set(range(1, L)))
    seq = ssd_sequence(ctx.seed, 10, L, ctx.dev)
    groups, states = [], []
    starts = (("from a zero state (None)", None), ("from an fp32 initial state", ssd_state(ctx.seed, 10, 1, ctx.dev)))
    for label, inits in starts:
        cases = []
        full_out, full_states = scan([seq], ctx.params, Q, inits, intermediate=True)
        for Lp in prefixes:
            got = {}

            def rows(Lp=Lp, got=got):
                got["out"], got["state"] = scan([_prefix(seq, Lp)], ctx.params, Q, inits)
                return got["out"], full_out[:Lp]
            case(cases, f"L'={Lp}", Lp, rows)
            if Lp % Q == 0 and "state" in got:
                case(states, f"L'={Lp}, {label}", Lp, lambda Lp=Lp, got=got: (got["state"][0], full_states[Lp // Q - 1]))
        groups.append({"name": f"first L' rows alone = full L={L}, {label}", "shape": SHAPE_SSD, "cases": cases,
                       "expected": "invariant (design A.3, inferred)"})
    groups.append({"name": "final state alone = full run's chunk-boundary state (rows: heads)", "shape": SHAPE_SSD,
                   "cases": states, "expected": "invariant (A.3)"})
    return groups


def _packed_inputs(ctx, Q: int):
    lens = [37, Q + 1, 1, 2 * Q + 5, Q, 3]
    seqs = [ssd_sequence(ctx.seed, 20 + i, n, ctx.dev) for i, n in enumerate(lens)]
    inits = ssd_state(ctx.seed, 20, len(lens), ctx.dev)
    inits[0::2] = 0                                     # sequences 0, 2, 4 start from a zero state
    return lens, seqs, inits


def probe_ssd_packed(ctx, Q: int) -> list:
    import itertools
    lens, seqs, inits = _packed_inputs(ctx, Q)
    shape = f"{SHAPE_SSD}, lengths {lens}"
    out, states = scan(seqs, ctx.params, Q, inits)
    starts = [0, *itertools.accumulate(lens)]
    rows, finals, rev, none_zero = [], [], [], []
    rout, rstates = scan(seqs[::-1], ctx.params, Q, inits.flip(0).contiguous())
    rstarts = [0, *itertools.accumulate(lens[::-1])]
    n = len(lens)
    for i, L in enumerate(lens):
        got = {}

        def alone(i=i, got=got):
            got["out"], got["state"] = scan([seqs[i]], ctx.params, Q, inits[i:i + 1].contiguous())
            return out[starts[i]:starts[i + 1]], got["out"]
        case(rows, f"seq {i} (L={L})", L, alone)
        if "state" in got:
            case(finals, f"seq {i} (L={L})", L, lambda i=i, got=got: (states[i], got["state"][0]))
        j = n - 1 - i
        case(rev, f"seq {i} (L={L})", L, lambda i=i, j=j: (out[starts[i]:starts[i + 1]], rout[rstarts[j]:rstarts[j + 1]]))
        if i % 2 == 0:
            case(none_zero, f"seq {i} (L={L})", L,
                 lambda i=i: (scan([seqs[i]], ctx.params, Q, None)[0],
                              scan([seqs[i]], ctx.params, Q, inits[i:i + 1].contiguous())[0]))
    return [{"name": "packed = each alone (outputs)", "shape": shape, "cases": rows, "expected": "invariant (A.3)"},
            {"name": "packed = each alone (final states; rows: heads)", "shape": shape, "cases": finals,
             "expected": "invariant (A.3)"},
            {"name": "packed in reverse order = packed (outputs)", "shape": shape, "cases": rev, "expected": "invariant"},
            {"name": "zero initial state as None = as a tensor (alone)", "shape": shape, "cases": none_zero,
             "expected": "invariant (A.3 HAS_INITSTATES, inferred)"}]


def probe_ssd_rerun(ctx, Q: int) -> list:
    lens, seqs, inits = _packed_inputs(ctx, Q)
    a_out, a_states = scan(seqs, ctx.params, Q, inits)
    b_out, b_states = scan(seqs, ctx.params, Q, inits)
    cases = []
    case(cases, "outputs", sum(lens), lambda: (a_out, b_out))
    case(cases, "final states (rows: sequences)", len(lens), lambda: (a_states, b_states))
    return [{"name": "the packed call twice, one process", "shape": f"{SHAPE_SSD}, lengths {lens}", "cases": cases,
             "expected": "invariant", "data": {"autotune": autotune_choices()}}]


def child(args) -> int:
    """--child PATH: the packed SSD call at the first chunk size, saved for the parent to compare."""
    import torch
    ctx = _context(args)
    Q = args.chunk_list[0]
    lens, seqs, inits = _packed_inputs(ctx, Q)
    out, states = scan(seqs, ctx.params, Q, inits)
    torch.save({"out": out.cpu(), "states": states.cpu(), "autotune": autotune_choices()}, args.child)
    return 0


def probe_ssd_two_process(ctx, Q: int) -> list:
    import torch
    lens, seqs, inits = _packed_inputs(ctx, Q)
    out, states = scan(seqs, ctx.params, Q, inits)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "child.pt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path), "--chunk-sizes", str(Q),
               "--seed", str(ctx.seed)] + (["--stock"] if ctx.stock else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        timeout = max(30.0, ctx.budget_s + 45.0 - (time.monotonic() - ctx.t0))
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the child process ran past {timeout:.0f} s") from None
        if p.returncode or not path.exists():
            tail = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise RuntimeError(f"the child process exited {p.returncode}: {tail}")
        theirs = torch.load(path)
    cases = []
    case(cases, "outputs", sum(lens), lambda: (out.cpu(), theirs["out"]))
    case(cases, "final states (rows: sequences)", len(lens), lambda: (states.cpu(), theirs["states"]))
    mine_at = autotune_choices()
    return [{"name": "the packed call in a second process (autotuned afresh)", "shape": f"{SHAPE_SSD}, lengths {lens}",
             "cases": cases, "expected": "invariant if both autotuners chose alike (A.3)",
             "notes": {"autotune choices equal": mine_at == theirs["autotune"]},
             "data": {"autotune (this process)": mine_at, "autotune (child)": theirs["autotune"]}}]


def replay_schedules(seed: int, Q: int, count: int) -> list:
    """The replay probe's schedules: {name, pieces (per sequence), steps [[(sequence, tokens)]],
    slots}. First a fixed one (cuts = Q-1, 1, 0 mod Q, decodes across a boundary, every unfinished
    request in every step), then `count` drawn from a seeded random.Random: 3 sequences of
    prefill pieces of drawn sizes then up to REPLAY_DECODE decode steps (often crossing a
    boundary), drawn requests per step, drawn cache slots."""
    import random
    fixed = [[Q - 1, 2, Q - 2] + [1] * 5, [Q, 1, Q - 1, 37] + [1] * 3, [Q - 3] + [1] * 5]
    out = [{"name": "fixed", "pieces": fixed, "steps": _interleave(fixed, None), "slots": [0, 1, 2]}]
    for k in range(count):
        rng = random.Random(seed * 1_000_003 + Q * 101 + k)
        pieces = []
        for _ in range(3):
            d = rng.randint(1, REPLAY_DECODE)
            p = rng.choice([rng.randint(1, 3 * Q), rng.randint(1, 2) * Q - rng.randint(0, d - 1)])
            sizes, left = [], p
            while left:
                sizes.append(rng.randint(1, min(left, 2 * Q + 3)))
                left -= sizes[-1]
            pieces.append(sizes + [1] * d)
        slots = rng.sample(range(6), 3)
        out.append({"name": f"drawn {k}", "pieces": pieces, "steps": _interleave(pieces, rng), "slots": slots})
    return out


def _interleave(pieces: list, rng) -> list:
    """Engine steps over the sequences' pieces in order: every unfinished one (rng None) or a drawn
    non-empty subset of them per step."""
    todo, steps = [list(p) for p in pieces], []
    while any(todo):
        ready = [j for j, t in enumerate(todo) if t]
        pick = ready if rng is None else sorted(rng.sample(ready, rng.randint(1, len(ready))))
        steps.append([(j, todo[j].pop(0)) for j in pick])
    return steps


def probe_replay(ctx, Q: int) -> list:
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from fixtures.vllm.mamba_replay_driver import ReplayDriver, Widths
    dev, prm, f32 = ctx.dev, ctx.params, torch.float32
    zero = torch.zeros(1, NHEADS, HEADDIM, DSTATE, device=dev)
    groups = []
    for k, sch in enumerate(replay_schedules(ctx.seed, Q, ctx.replay_schedules)):
        name, slots = f"replay {sch['name']}", sch["slots"]
        shape = f"{SHAPE_SSD}, lengths {[sum(p) for p in sch['pieces']]}, {len(sch['steps'])} steps"
        try:
            seqs = [ssd_sequence(ctx.seed, 80 + 10 * k + j, sum(p), dev) for j, p in enumerate(sch["pieces"])]
            # a zero state as a tensor, as replay passes it; fp32 outputs (the kernel stores its fp32
            # accumulator in out's dtype): equal fp32 rows are equal bf16 rows, not the other way round
            ref = [scan([s], prm, Q, zero, intermediate=True, out_dtype=f32) for s in seqs]
            drv = ReplayDriver(Widths(NHEADS, HEADDIM, DSTATE, NGROUPS, Q), max(slots) + 1, A=prm["A"],
                               scan=mamba_chunk_scan_combined_varlen, D=prm["D"], dt_bias=prm["dt_bias"],
                               dtype=torch.bfloat16, device=dev)
            got, pos, mine, want = [[] for _ in seqs], [0] * len(seqs), [], []
            for step in sch["steps"]:
                for j, _ in step:
                    if pos[j] == 0:
                        drv.reset(slots[j])
                cat = {key: torch.cat([seqs[j][key][pos[j]:pos[j] + n] for j, n in step]) for key in ("x", "dt", "B", "C")}
                lens = [n for _, n in step]
                y = drv.step([slots[j] for j, _ in step], [pos[j] for j, _ in step], cat["x"], cat["dt"], cat["B"],
                             cat["C"], lens, out=torch.full_like(cat["x"], float("nan"), dtype=f32))
                for (j, n), part in zip(step, y.split(lens)):
                    got[j].append(part)
                    pos[j] += n
                    b = drv.boundary(slots[j])
                    if b:
                        mine.append(drv.ssm[slots[j]].clone())
                        want.append(ref[j][1][b // Q - 1])
        except Exception as exc:
            groups.append({"name": name, "shape": shape, "cases": [], "error": _error(exc)})
            continue
        outs, states = [], []
        for j, s in enumerate(seqs):
            case(outs, f"seq {j} (L={len(s['x'])})", len(s["x"]), lambda j=j: (torch.cat(got[j]), ref[j][0]))
        if mine:
            case(states, f"{len(mine)} (step, request) pairs", len(mine), lambda: (torch.stack(mine), torch.stack(want)))
        groups += [{"name": f"{name}: outputs = unsplit", "shape": shape, "cases": outs,
                    "expected": "invariant (design C.2 iv; rests on A.3's partial-chunk property)"},
                   {"name": f"{name}: fp32 boundary state after every step = unsplit chunk state (rows: steps)",
                    "shape": shape, "cases": states, "expected": "invariant (C.2 iii, iv)"}]
    ctl = []
    L = 2 * Q + 5
    seq = ssd_sequence(ctx.seed, 79, L, dev)
    full, _ = scan([seq], prm, Q, zero, out_dtype=f32)
    for cut in (1, Q // 2 + 1, Q - 1, Q + 1):
        def stock(cut=cut):
            first, after = scan([_prefix(seq, cut)], prm, Q, zero, out_dtype=f32)
            second, _ = scan([{key: v[cut:] for key, v in seq.items()}], prm, Q, after.contiguous(), out_dtype=f32)
            return torch.cat([first, second]), full
        case(ctl, f"cut at {cut}", cut, stock)
    groups.append({"name": "stock continuation: chunk from the cut, state after the last token (control)",
                   "shape": f"{SHAPE_SSD}, L={L}", "cases": ctl,
                   "expected": "variant (A.2); invariant here means the check cannot see chunking: inconclusive"})
    return groups


def _conv_state(lines: int, dev):
    """A conv-state cache in vLLM's default "SD" layout, seen as (lines, dim, width-1) as the mixer passes it."""
    import torch
    return torch.zeros(lines, CONV_WIDTH - 1, CONV_DIM, dtype=torch.bfloat16, device=dev).transpose(1, 2)


def probe_conv(ctx, Q: int) -> list:
    import torch
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    dev, bf, i32 = ctx.dev, torch.bfloat16, torch.int32
    g = _gen(ctx.seed, 40)
    weight = (torch.randn(CONV_DIM, CONV_WIDTH, generator=g) * 0.5).to(bf).to(dev)
    bias = (torch.randn(CONV_DIM, generator=g) * 0.1).to(bf).to(dev)
    lens = [37, Q + 37, 1, 64]
    xs = [torch.randn(n, CONV_DIM, generator=g).to(bf).to(dev) for n in lens]
    init = torch.randn(len(lens), CONV_DIM, CONV_WIDTH - 1, generator=g).to(bf).to(dev)
    has_init = [True, True, False, True]

    def fn(seq_ids, x_list, states=None, flags=None):
        """causal_conv1d_fn over the sequences packed (cache line i+1 for sequence seq_ids[i]; line 0 is
        vLLM's null block); returns (out [T, dim], the conv-state cache)."""
        cs = _conv_state(len(seq_ids) + 1, dev)
        for line, s in enumerate(seq_ids, 1):
            cs[line] = init[s] if states is None else states[line - 1]
        x = torch.cat(x_list)
        qsl = torch.tensor([0, *torch.tensor([len(t) for t in x_list]).cumsum(0).tolist()], dtype=i32, device=dev)
        flags = [has_init[s] for s in seq_ids] if flags is None else flags
        out = causal_conv1d_fn(x.transpose(0, 1), weight, bias, conv_states=cs, query_start_loc=qsl,
                               cache_indices=torch.arange(1, len(seq_ids) + 1, dtype=i32, device=dev),
                               has_initial_state=torch.tensor(flags, dtype=torch.bool, device=dev),
                               activation="silu").transpose(0, 1)
        return out, cs

    s = 1                                   # the Q+37 sequence, from a non-zero conv state
    L = lens[s]
    out_fn, cs_fn = fn([s], [xs[s]])
    cs_up = _conv_state(2, dev)
    cs_up[1] = init[s]
    steps = []
    for t in range(L):
        steps.append(causal_conv1d_update(xs[s][t:t + 1].clone(), cs_up, weight, bias, activation="silu",
                                          conv_state_indices=torch.tensor([1], dtype=i32, device=dev)))
    upd, fin, packed, split = [], [], [], []
    case(upd, f"{L} tokens", L, lambda: (torch.cat(steps), out_fn))
    case(fin, "after the sequence (rows: taps)", CONV_WIDTH - 1, lambda: (cs_up[1].t(), cs_fn[1].t()))
    out_all, _ = fn(list(range(len(lens))), xs)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for i, n in enumerate(lens):
        case(packed, f"seq {i} (L={n})", n, lambda i=i: (out_all[starts[i]:starts[i + 1]], fn([i], [xs[i]])[0]))
    for cut in (1, 37, Q):
        def halves(cut=cut):
            first, cs1 = fn([s], [xs[s][:cut]])
            second, _ = fn([s], [xs[s][cut:]], states=[cs1[1].clone()], flags=[True])
            return torch.cat([first, second]), out_fn
        case(split, f"split at {cut}", cut, halves)
    shape = f"dim={CONV_DIM} width={CONV_WIDTH}"
    return [{"name": "causal_conv1d_update per token = causal_conv1d_fn row", "shape": shape, "cases": upd,
             "expected": "invariant (design A.5, inferred)"},
            {"name": "final conv state: update = fn", "shape": shape, "cases": fin, "expected": "invariant (A.5)"},
            {"name": "fn packed = each alone", "shape": f"{shape}, lengths {lens}", "cases": packed,
             "expected": "invariant (C.1)"},
            {"name": "fn split in two, conv state carried = unsplit", "shape": f"{shape}, L={L}", "cases": split,
             "expected": "invariant (C.1)"}]


def probe_ssu(ctx, Q: int) -> list:
    import torch
    from vllm.model_executor.layers.mamba.ops import mamba_ssm
    from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
    dev, P, N = ctx.dev, HEADDIM, DSTATE
    A_e = ctx.params["A"][:, None, None].expand(-1, P, N).to(torch.float32)     # as MambaMixer2 passes them
    D_e = ctx.params["D"][:, None].expand(-1, P)
    bias_e = ctx.params["dt_bias"][:, None].expand(-1, P)

    def step(state, x, dt, B, C):
        out = torch.empty_like(x)
        selective_state_update(state, x, dt[:, :, None].expand(-1, -1, P), A_e, B, C, D_e, bias_e,
                               dt_softplus=True, out=out)
        return out

    seq = ssd_sequence(ctx.seed, 50, Q + SSU_STEPS, dev)
    s0 = ssd_state(ctx.seed, 50, 1, dev)
    _, s_q = scan([_prefix(seq, Q)], ctx.params, Q, s0)           # the fp32 state after the first chunk
    full_out, full_state = scan([seq], ctx.params, Q, s0)
    state = s_q.clone()
    rows = [step(state, *(seq[k][Q + t:Q + t + 1] for k in ("x", "dt", "B", "C"))) for t in range(SSU_STEPS)]
    ctl, ctl_state, batch = [], [], []
    case(ctl, f"{SSU_STEPS} decode steps after Q={Q}", SSU_STEPS, lambda: (torch.cat(rows), full_out[Q:]))
    case(ctl_state, f"after {SSU_STEPS} steps (rows: heads)", SSU_STEPS, lambda: (state[0], full_state[0]))
    big = max(SSU_BATCHES)
    bseq = ssd_sequence(ctx.seed, 51, big, dev)
    bstate = ssd_state(ctx.seed, 51, big, dev)
    ref_state = bstate.clone()
    ref = step(ref_state, bseq["x"], bseq["dt"], bseq["B"], bseq["C"])
    launch = {}
    for b in SSU_BATCHES[:-1]:
        case(batch, f"batch {b}", b, lambda b=b: (step(bstate[:b].clone(), *(bseq[k][:b] for k in ("x", "dt", "B", "C"))),
                                                  ref[:b]))
    for b in SSU_BATCHES:
        try:
            launch[b] = mamba_ssm.try_get_optimal_ssm_config(P, N, b, NHEADS, "float32", False)
        except Exception as exc:
            launch[b] = f"error: {exc}"
    try:
        tuned = mamba_ssm.get_ssm_configs(P, N, "float32") is not None
    except Exception as exc:
        tuned = f"error: {exc}"
    return [{"name": "selective_state_update decode = chunk-scan row (control)", "shape": SHAPE_SSD, "cases": ctl,
             "expected": "variant (A.4: a different algorithm)"},
            {"name": "selective_state_update state = chunk-scan final state (control)", "shape": SHAPE_SSD,
             "cases": ctl_state, "expected": "variant (A.4)"},
            {"name": f"selective_state_update rows at batch b = batch {big}", "shape": f"{SHAPE_SSD}, fp32 state",
             "cases": batch, "expected": "invariant without a tuned config file (A.4)",
             "notes": {"tuned config file found": tuned,
                       "(BLOCK_SIZE_M, num_warps) by batch": json.dumps({str(k): list(v) if isinstance(v, tuple) else v
                                                                         for k, v in launch.items()})}}]


def probe_fp8_linear(ctx, Q: int | None = None) -> list:
    import torch
    from vllm import _custom_ops as ops
    dev, bf = ctx.dev, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(ctx.seed + 60)
    notes = {}
    try:
        from vllm.model_executor.layers.quantization.utils.w8a8_utils import cutlass_fp8_supported
        notes["cutlass_fp8_supported (Fp8 online linear: per-token activations if True)"] = bool(cutlass_fp8_supported())
    except Exception as exc:
        notes["cutlass_fp8_supported"] = f"error: {exc}"
    groups = []
    big = max(FP8_SIZES)
    for N, K in FP8_SHAPES:
        shape = f"N={N} K={K}"
        w = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(bf)
        qw, ws = ops.scaled_fp8_quant(w, None)            # per-tensor weight, as process_weights_after_loading
        Bm = qw.t()                                       # [K, N] column-major, as the layer keeps it
        x = torch.randn(big, K, generator=g, device=dev).to(bf)
        static = (x.abs().max().float() / 448.0).reshape(1)

        def per_token(M):
            xq, xs = ops.scaled_fp8_quant(x[:M], use_per_token_if_dynamic=True)
            return xq, xs, ops.cutlass_scaled_mm(xq, Bm, scale_a=xs, scale_b=ws, out_dtype=bf)

        def static_mm(M):
            xq, _ = ops.scaled_fp8_quant(x[:M], static)
            return ops.cutlass_scaled_mm(xq, Bm, scale_a=static, scale_b=ws, out_dtype=bf)

        def dyn_tensor(M):
            xq, xs = ops.scaled_fp8_quant(x[:M])
            return ops.cutlass_scaled_mm(xq, Bm, scale_a=xs, scale_b=ws, out_dtype=bf)

        ref_q, ref_s, ref = per_token(big)
        ref_static, ref_dyn = static_mm(big), dyn_tensor(big)
        gemm, quant, stat, dyn = [], [], [], []
        for M in FP8_SIZES[:-1]:
            got = {}

            def pt(M=M, got=got):
                got["q"], got["s"], y = per_token(M)
                return y, ref[:M]
            case(gemm, f"M={M}", M, pt)
            if "q" in got:
                case(quant, f"M={M} fp8 bits", M, lambda M=M, got=got: (got["q"], ref_q[:M]))
                case(quant, f"M={M} scales", M, lambda M=M, got=got: (got["s"], ref_s[:M]))
            case(stat, f"M={M}", M, lambda M=M: (static_mm(M), ref_static[:M]))
            case(dyn, f"M={M}", M, lambda M=M: (dyn_tensor(M), ref_dyn[:M]))
        groups += [{"name": f"per-token dynamic + cutlass_scaled_mm: M rows = rows of M={big}", "shape": shape,
                    "cases": gemm, "expected": "variant across M buckets 16/17, 64/65, 128/129 (D.1, inferred)",
                    "notes": notes if (N, K) == FP8_SHAPES[0] else {}},
                   {"name": "per-token activation quant (fp8 bits, scales) = rows of the largest", "shape": shape,
                    "cases": quant, "expected": "invariant (D.1: max is exact)"},
                   {"name": "static per-tensor activation scale + cutlass_scaled_mm", "shape": shape, "cases": stat,
                    "expected": "as the per-token GEMM (the scale is fixed)"},
                   {"name": "dynamic per-tensor activation scale (control)", "shape": shape, "cases": dyn,
                    "expected": "variant (the scale depends on the batch)"}]
        del w, qw, Bm, x
    return groups


def probe_fp8_moe(ctx, Q: int | None = None) -> list:
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts, try_get_optimal_moe_config
    dev, bf = ctx.dev, torch.bfloat16
    H, I = MOE_HIDDEN, MOE_INTERMEDIATE
    g = torch.Generator(device=dev).manual_seed(ctx.seed + 70)
    big = max(MOE_SIZES)
    groups = []
    for E, k in ctx.moe:
        shape = f"E={E} top_k={k} hidden={H} intermediate={I}"
        try:
            w1 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).to(bf)
            w2 = (torch.randn(E, H, I, generator=g, device=dev) * 0.02).to(bf)
            q1, s1 = _quant_experts(ops, w1)
            q2, s2 = _quant_experts(ops, w2)
            del w1, w2
            x = torch.randn(big, H, generator=g, device=dev).to(bf)
            logits = torch.randn(big, E, generator=g, device=dev)
            topk_w, topk_i = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
            topk_i = topk_i.to(torch.int32)
            a1 = (x.abs().max().float() / 448.0).reshape(1)
            a2 = torch.tensor([MOE_A2_SCALE], dtype=torch.float32, device=dev)
            variants = {
                "dynamic per-tensor activation scale (the online FP8 MoE method's)":
                    (fp8_w8a8_moe_quant_config(w1_scale=s1, w2_scale=s2), "variant (D.2: one scale per batch)"),
                "static per-tensor activation scale":
                    (fp8_w8a8_moe_quant_config(w1_scale=s1, w2_scale=s2, a1_scale=a1, a2_scale=a2),
                     "invariant if the Triton config is fixed (D.2)"),
                "dynamic per-token activation scale (per-tensor weight scales broadcast per channel)":
                    (fp8_w8a8_moe_quant_config(w1_scale=s1[:, None, None].expand(E, 2 * I, 1).contiguous(),
                                               w2_scale=s2[:, None, None].expand(E, H, 1).contiguous(),
                                               per_act_token_quant=True),
                     "invariant (D.2 drop-in)"),
            }
        except Exception as exc:
            groups.append({"name": "setup", "shape": shape, "cases": [], "error": _error(exc)})
            continue
        notes = {}
        try:
            notes["Triton config by M"] = json.dumps({M: try_get_optimal_moe_config(q1.size(), q2.size(), k, "fp8_w8a8", M)
                                                      for M in MOE_SIZES})
        except Exception as exc:
            notes["Triton config by M"] = f"error: {exc}"
        notes["naive block assignment (M*top_k*4 <= E) at M"] = [M for M in MOE_SIZES if M * k * 4 <= E]
        for name, (qc, expected) in variants.items():
            def run(M, qc=qc):
                return fused_experts(x[:M], q1, q2, topk_w[:M], topk_i[:M], quant_config=qc)
            cases = []
            try:
                ref = run(big)
            except Exception as exc:
                groups.append({"name": name, "shape": shape, "cases": [], "error": _error(exc), "expected": expected})
                continue
            for M in MOE_SIZES[:-1]:
                case(cases, f"M={M}", M, lambda M=M, run=run, ref=ref: (run(M), ref[:M]))
            groups.append({"name": f"{name}: M rows = rows of M={big}", "shape": shape, "cases": cases,
                           "expected": expected, "notes": notes})
            notes = {}                              # printed once per E x top_k
        del q1, q2, x
    return groups


def _quant_experts(ops, w):
    """Each expert's weight quantized per tensor (scaled_fp8_quant with no scale), as the online
    FP8 MoE method does: (fp8 [E, n, k], fp32 scales [E])."""
    import torch
    qs, ss = zip(*(ops.scaled_fp8_quant(w[e].contiguous(), None) for e in range(w.shape[0])))
    return torch.stack(qs), torch.cat([s.reshape(1) for s in ss]).float()


PROBE_FUNCS = {"ssd_prefix": probe_ssd_prefix, "ssd_packed": probe_ssd_packed, "ssd_rerun": probe_ssd_rerun,
               "replay": probe_replay,
               "conv": probe_conv, "ssu": probe_ssu, "fp8_linear": probe_fp8_linear, "fp8_moe": probe_fp8_moe,
               "ssd_two_process": probe_ssd_two_process}
NO_CHUNK = ("fp8_linear", "fp8_moe")


def jobs(probe_list: list, chunk_list: list) -> list:
    """(probe, chunk size or None) in run order: every probe at the first chunk size (the
    two-process one last), then the per-chunk SSD probes at the other chunk sizes."""
    first, rest = chunk_list[0], chunk_list[1:]
    out = [(p, None if p in NO_CHUNK else first) for p in probe_list]
    return out + [(p, q) for q in rest for p in probe_list if p in PER_CHUNK]


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _context(args, t0: float | None = None):
    import torch
    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = argparse.Namespace(dev=dev, seed=args.seed, stock=args.stock, moe=args.moe_list, budget_s=args.budget_s,
                             replay_schedules=args.replay_schedules,
                             t0=time.monotonic() if t0 is None else t0)
    ctx.params = ssd_params(args.seed, dev)
    return ctx


def _meta(args) -> dict:
    import torch
    meta = {"VLLM_BATCH_INVARIANT": os.environ.get("VLLM_BATCH_INVARIANT"), "seed": args.seed,
            "chunk_sizes": args.chunk_list, "torch": torch.__version__, "widths": SHAPE_SSD,
            "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    for mod in ("vllm", "triton"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as exc:
            meta[mod] = f"error: {exc}"
    return meta


def _write(path, results) -> None:
    if path:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(path)


def main(argv=None) -> int:
    t0 = time.monotonic()
    try:
        args = parse_args(argv)
    except ValueError as exc:
        msg = (str(exc) or repr(exc)).splitlines()[0]
        print(f"error: {msg}", file=sys.stderr)
        return 2
    missing = gpu_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 3
    set_environment(args.stock)                 # before anything imports vLLM
    if args.child:
        return child(args)
    results = {"meta": _meta(args), "probes": []}
    ctx = _context(args, t0)
    for probe, Q in jobs(args.probe_list, args.chunk_list):
        rec = {"probe": probe, "chunk_size": Q}
        spent = time.monotonic() - ctx.t0
        if spent > args.budget_s:
            rec["skipped"] = f"time budget ({args.budget_s:.0f} s) spent"
        else:
            t = time.perf_counter()
            try:
                rec["groups"] = PROBE_FUNCS[probe](ctx, Q)
            except Exception as exc:
                rec["error"] = _error(exc)
            rec["seconds"] = round(time.perf_counter() - t, 2)
        results["probes"].append(rec)
        verdicts = [summarize(g)["verdict"] for g in rec.get("groups", [])]
        print(f"{probe}{f' Q={Q}' if Q else ''}: {rec.get('skipped') or rec.get('error') or ', '.join(verdicts)} "
              f"({rec.get('seconds', 0):.1f} s)", file=sys.stderr, flush=True)
        results["meta"]["elapsed_s"] = round(time.monotonic() - ctx.t0, 1)
        _write(args.json, results)
    try:
        results["meta"]["ssd_autotune"] = autotune_choices()
    except Exception as exc:
        results["meta"]["ssd_autotune"] = f"error: {exc}"
    _write(args.json, results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
