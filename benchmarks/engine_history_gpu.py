"""Does an engine's output depend on what it ran before? (C5 finding of 2026-12-01/02.)

C5's `test_max_batch_size[qwen3-1]` failed twice with the same bits (444 ULP on w0's first sampled
token) while a cold rerun of both engines gave equal results: one engine's first run depended on
something its rerun lacked. This probe asks whether that is the engine's own history, without
pytest's scheduling or other workers in the way. For each engine configuration it starts a fresh engine and runs C5's mixed workload
from a cold prefix cache:

    first            the engine's first generate() (module rows of w0 recorded)
    second           the same again, cold
    after history    after a history of other workloads (long prompts, steps past 256 and 1024
                     tokens, several samples; what C3/C4 leave an engine with), cold again

and a second fresh engine of the same configuration runs `first` without recording (recording
must not change the bits). Every run is compared bitwise with the configuration's `first` (every
request, every sampled logprob), and each configuration's `first` with the default's. Where two
recorded runs differ, the first module whose rows of w0 differ is named.

    VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/engine_history_gpu.py --model qwen3 --proxy shallow
    ... --hold-gib 120                                    # the same on a nearly full device
    ... --fake echo                                       # the script itself, on the CPU

Prints one markdown table and exits 0; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.c10_side_by_side_gpu import add_model_arguments, model_dir  # noqa: E402

CONFIGS = (("default", {}), ("max_num_seqs=1", {"max_num_seqs": 1}),
           ("max_num_seqs=1, sync scheduling", {"max_num_seqs": 1, "async_scheduling": False}))
WATCHED = "w0"


def history_workloads(vocab: int):
    """What an engine of a pytest run has typically served before C5: a long prompt (steps past
    1024 tokens), a batch past 256 tokens with several samples, C3-sized batches."""
    from fixtures.checks.workloads import fixed_batch, random_requests
    from fixtures.core.contract import SamplingParams
    yield random_requests(vocab, 1, seed=11, lengths=(1500, 1501), prefix="long",
                          params=lambda i: SamplingParams(max_tokens=8, temperature=1.0, seed=7))
    yield random_requests(vocab, 48, seed=12, lengths=(1, 300), prefix="h",
                          params=lambda i: SamplingParams(max_tokens=4 + i % 13, temperature=1.0, seed=i, n=2))
    for n in (1, 17, 64):
        yield fixed_batch(vocab, n, seed=n)


def differences(got, want) -> tuple[int, str]:
    """(how many sampled logprobs differ, the first one described) over every request and sample;
    a sample whose tokens differ counts once."""
    from fixtures.core.comparison import compare
    count, first = 0, ""
    for c, w in zip(got, want):
        for k, (s, t) in enumerate(zip(c.samples, w.samples)):
            if s.token_ids != t.token_ids:
                count += 1
                first = first or f"{c.request_id} sample {k}: tokens {s.token_ids[:6]} vs {t.token_ids[:6]}"
                continue
            d = compare(s.logprobs, t.logprobs)
            if not d.equal:
                count += d.count or 1
                first = first or (f"{c.request_id} sample {k}: {d.structural}" if d.structural else
                                  f"{c.request_id} sample {k} token {d.first[1]}: {d.lhs_hex} vs {d.rhs_hex}, "
                                  f"{d.ulp} ULP")
    return count, first


def watched_bits(out) -> str:
    from fixtures.core.comparison import float_hex
    c = next(c for c in out if c.request_id == WATCHED)
    return float_hex(c.samples[0].logprobs[0])


def probe(path: Path, vocab: int, *, fake: str | None, fixes: str, configs=CONFIGS) -> list[tuple]:
    from fixtures.checks.workloads import mixed_workload
    from fixtures.core.contract import EngineSettings
    from fixtures.vllm.client import VLLMEngine
    reqs = mixed_workload(vocab)
    rows_out, firsts = [], {}

    def cold(engine, record: bool):
        engine.reset_prefix_cache()
        if not record:
            out, rows = engine.generate(reqs), None
        else:
            with engine.record_rows(WATCHED) as rows:
                out = engine.generate(reqs)
        return out, rows, first_step(engine)

    for name, knobs in configs:
        settings = EngineSettings(batch_invariant=True, extra={"env": {"CONFORMANCE_VLLM_FIXES": fixes}}, **knobs)
        engine = VLLMEngine(path, settings, fake=fake)
        try:
            runs = [("first", *cold(engine, True)), ("second", *cold(engine, True))]
            for batch in history_workloads(vocab):
                engine.generate(batch)
            runs.append(("after history", *cold(engine, True)))
            history = engine.history()
        finally:
            engine.close()
        engine = VLLMEngine(path, settings, fake=fake)
        try:
            runs.append(("first, not recorded (a second fresh engine)", *cold(engine, False)))
        finally:
            engine.close()
        first_out, first_rows = runs[0][1], runs[0][2]
        firsts[name] = (first_out, first_rows)
        for label, out, rows, step in runs:
            n, where = differences(out, first_out)
            module = first_rows.first_divergence(rows, names=("first", label)) if rows is not None and n else None
            rows_out.append((name, label, watched_bits(out), "equal" if not n else f"**{n} differ**: {where}",
                             module or ("" if not n else "(w0's recorded rows equal)" if rows is not None else ""),
                             step))
        rows_out.append((name, f"(engine history at the end: {history})", "", "", "", ""))
        print(f"{name}: done", file=sys.stderr, flush=True)
    base_out, base_rows = firsts[configs[0][0]]
    for name, (out, rows) in list(firsts.items())[1:]:
        n, where = differences(out, base_out)
        module = base_rows.first_divergence(rows, names=(configs[0][0], name)) if n else None
        verdict = "equal" if not n else f"**{n} differ**: {where}"
        rows_out.append((f"{name} vs {configs[0][0]}", "first runs", "", verdict, module or "", ""))
    return rows_out


def hold(gib: float):
    """`gib` GiB of GPU memory held by this process (None without CUDA or when 0)."""
    import torch
    if not gib or not torch.cuda.is_available():
        return None
    held = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info()
    print(f"holding {gib:g} GiB; {free / (1 << 30):.1f} of {total / (1 << 30):.1f} GiB free", file=sys.stderr)
    return held


def first_step(engine) -> str:
    """'N steps, the first of T tokens' of the engine's last generate() (what shared w0's step)."""
    tokens = list(engine.last_stats().step_tokens or [])
    return f"{len(tokens)} steps, the first of {tokens[0]} tokens" if tokens else "(no step trace)"


def table(rows) -> str:
    lines = ["| engine | run | w0 token 0 logprob | vs the engine's first run | first diverging module of w0 | steps |",
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--fixes", default="all", help="what the engines install (--vllm-fixes spelling)")
    ap.add_argument("--hold-gib", type=float, default=0.0,
                    help="GPU memory this process holds while the engines run (a device as full as a -n 4 run "
                         "leaves it: a library that falls back to another algorithm when its workspace does not "
                         "fit would show here)")
    args = ap.parse_args(argv)
    from fixtures.vllm.fixes import parse
    try:
        parse(args.fixes)
        if not args.hold_gib >= 0:
            raise ValueError("--hold-gib: expected a size in GiB >= 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import json
    held = hold(args.hold_gib)      # noqa: F841 (kept alive until the probe ends)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args, Path(tmp))
        vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        print(table(probe(path, vocab, fake=args.fake, fixes=args.fixes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
