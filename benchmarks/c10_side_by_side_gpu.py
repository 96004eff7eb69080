"""C10's rollout workload on three engines of one model in one run: stock vLLM (invariance off),
invariance on (VLLM_BATCH_INVARIANT=1, no fixes), invariance on + the fix pack (--vllm-fixes):
tok/s each and the ratios to stock (issue #21 item 3). The gate measures two of them (on vs off);
this is the side-by-side for the fix pack's cost.

Why a script and not the gate: the third configuration is the vLLM adapter's own knob
(CONFORMANCE_VLLM_FIXES in the engine worker), not a contract setting every implementation has.
Each engine is measured as C10 measures one (fixtures.checks.throughput.time_rollout: a warm-up,
then the fastest of two timed runs, CUDA graphs on where the engine has them, the engine's own
clock), one engine at a time, and the three are measured `--rounds` times in turn so a drift of
the machine shows as spread rather than as a ratio: each ratio is the median of its per-round
ratios, printed with their min and max. The workload is fitted to the KV cache the first engine
reports, as C10 fits its own (fixtures.checks.throughput.fit_to_kv_cache: the sequences that run at
once fit at full length, so no preemption storm is measured as throughput; `--no-fit` keeps it as
given and the table shows the preemptions). Run it alone on the GPU (not beside a pytest run:
other work on the device skews tok/s).

    VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/c10_side_by_side_gpu.py --model qwen3 --proxy shallow
    ... --model qwen3 --proxy full --proxy-weights engine-dummy        # full depth, vLLM's dummy weights
    ... --profile-top 15                                                # + each engine's top kernels by device time
    ... --fake echo                                                     # the script itself, on the CPU

Prints one table (markdown) and exits 0; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = (("stock (invariance off)", False, "none"),
           ("invariance on", True, "none"),
           ("invariance on + fixes", True, "all"))


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The options `model_dir` reads, and the fake worker backend (also benchmarks/compiled_bisect_gpu.py's)."""
    ap.add_argument("--model", default="qwen3", help="a recipe name or a model directory (config.json + weights)")
    ap.add_argument("--proxy", default="shallow", choices=("tiny", "shallow", "full"))
    ap.add_argument("--proxy-weights", default="files", choices=("files", "engine-dummy"))
    ap.add_argument("--fake", default=None, help="a fake vLLM worker backend (CPU self-test), e.g. echo")


def model_dir(args, tmp: Path) -> Path:
    from fixtures.models.proxies import build_engine_dummy, build_proxy
    given = Path(args.model)
    if (given / "config.json").is_file():
        return given
    if args.proxy_weights == "engine-dummy":
        return build_engine_dummy(args.model, args.proxy, tmp / "proxy").path
    import torch
    return build_proxy(args.model, args.proxy, tmp / "proxy", dtype=torch.bfloat16).path


def measure(path: Path, workload, *, rounds: int, fake: str | None, fixes_all: str,
            kv_bytes: int | None = None, profile_top: int = 0, profiles: dict | None = None,
            fit: bool = True) -> tuple[dict[str, list], object, str]:
    """(each engine's Throughput per round, the workload run, how it was fitted); with
    `profile_top`, `profiles[name]` gets its kernels by device time from one more (untimed)
    rollout of the last round (fixtures.vllm.kernel_profile)."""
    from fixtures.checks.throughput import time_rollout
    from fixtures.core.contract import EngineSettings
    from fixtures.vllm.client import VLLMEngine
    import json
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    out: dict[str, list] = {name: [] for name, _, _ in CONFIGS}
    # one eager start says whether the engine has CUDA graphs; an engine of the three that then
    # does not run the graphs asked for fails its start (VLLMResolutionError), never a quiet eager run
    from fixtures.checks.throughput import fit_to_kv_cache
    from fixtures.core.contract import ReportsKVCache
    probe_extra = {"env": {"CONFORMANCE_VLLM_FIXES": "none"}} | ({"kv_cache_memory_bytes": kv_bytes} if kv_bytes else {})
    engine = VLLMEngine(path, EngineSettings(batch_invariant=False, extra=probe_extra), fake=fake)
    try:
        graphs = bool(engine.capabilities().cuda_graphs)
        capacity = [dict(engine.kv_cache_capacity())] if isinstance(engine, ReportsKVCache) else []
    finally:
        engine.close()
    workload, fitted = fit_to_kv_cache(workload, capacity) if fit else (workload, "as given (--no-fit)")
    print(f"workload {workload.describe()}: {fitted}", file=sys.stderr, flush=True)
    for _ in range(rounds):
        for name, invariant, fixes in CONFIGS:
            env = {"CONFORMANCE_VLLM_FIXES": fixes_all if fixes == "all" else "none"}
            extra = {"env": env} | ({"kv_cache_memory_bytes": kv_bytes} if kv_bytes else {})
            settings = EngineSettings(batch_invariant=invariant, cuda_graphs=True if graphs else None, extra=extra)
            engine = VLLMEngine(path, settings, fake=fake)
            try:
                out[name].append(time_rollout(engine, workload, vocab, batch_invariant=invariant, cuda_graphs=graphs))
                if profile_top and profiles is not None:
                    profiles[name] = engine.kernel_profile(workload.requests(vocab, run=1), top=profile_top)
                    from fixtures.vllm.kernel_profile import table as kernel_table
                    print(kernel_table(name, profiles[name]), file=sys.stderr, flush=True)
            finally:
                engine.close()
            print(f"{name}: {out[name][-1].describe()}", file=sys.stderr, flush=True)    # kept if the run is cut
    return out, workload, fitted


def table(results: dict[str, list], workload, fitted: str = "") -> str:
    """The markdown table: per engine the median tok/s, every round's, the ratio to stock as the
    median of the per-round ratios (stock of the same round) with its min and max, and the steps,
    graph replays, most sequences in a step and preemptions of its median round."""
    import statistics
    stock = results[CONFIGS[0][0]]
    lines = [f"workload: {workload.describe()}" + (f" ({fitted})" if fitted else ""), "",
             "| engine | tok/s (median of rounds) | every round | ratio to stock: median (min - max) | "
             "steps / graph replays | most sequences in a step / preemptions |",
             "|---|---|---|---|---|---|"]
    for name, _, _ in CONFIGS:
        ms = results[name]
        ratios = [m.tokens_per_s / s.tokens_per_s for m, s in zip(ms, stock)]
        mid = sorted(ms, key=lambda m: m.tokens_per_s)[(len(ms) - 1) // 2]
        lines.append(f"| {name} | {statistics.median(m.tokens_per_s for m in ms):,.0f} | "
                     f"{', '.join(f'{m.tokens_per_s:,.0f}' for m in ms)} | {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f} - {max(ratios):.3f}) | {mid.steps} / {mid.graph_steps} | "
                     f"{mid.max_running} / {sum(m.preemptions for m in ms)} over the rounds |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--rollout-workload", default="256,256,128,4", help="PROMPTS,IN,OUT,N as C10's option")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-fit", action="store_true",
                    help="keep the workload as given even where the KV cache cannot hold its running sequences")
    ap.add_argument("--fixes", default="all", help="what the third engine installs (--vllm-fixes spelling)")
    ap.add_argument("--profile-top", type=int, default=0,
                    help="after the timed runs, one more rollout per engine under the profiler: its N kernels by "
                         "device time (what limits the fixed engine against stock)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each engine's KV cache (default: the suite's 4 GiB, which holds about 29k tokens of "
                         "Qwen3-8B at full depth - fewer than the workload's running sequences need)")
    args = ap.parse_args(argv)
    from fixtures.checks.workloads import parse_rollout_workload
    from fixtures.vllm.fixes import parse
    try:
        workload = parse_rollout_workload(args.rollout_workload)
        parse(args.fixes)
        if args.rounds < 1:
            raise ValueError("--rounds: expected a whole number >= 1")
        if args.profile_top < 0:
            raise ValueError("--profile-top: expected a whole number >= 0")
        if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
            raise ValueError("--kv-cache-gib: expected a size in GiB > 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args, Path(tmp))
        kv = int(args.kv_cache_gib * (1 << 30)) if args.kv_cache_gib else None
        profiles: dict = {}
        results, workload, fitted = measure(path, workload, rounds=args.rounds, fake=args.fake, fixes_all=args.fixes,
                                            kv_bytes=kv, profile_top=args.profile_top, profiles=profiles,
                                            fit=not args.no_fit)
    print(table(results, workload, fitted))
    from fixtures.vllm.kernel_profile import table as kernel_table
    for name, profile in profiles.items():
        print("\n" + kernel_table(name, profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
