"""The module-built trainer's first GPU step (issue #46): does the forward of vLLM's own model class,
built in this process and wrapped (fixtures.vllm.module_trainer.ModuleBuiltModel), reproduce the
engine's bits, and which layers are n/a? One command per family.

Per model: a seeded bf16 proxy (fixtures.models.proxies.build_proxy); ModuleBuiltModel built with
unknown layers allowed, so every n/a layer is listed by module path and class (a model with any is
reported and skipped: its forward would not be the trainer's); the packed logprobs of `--sequences`
random sequences (lengths 16..600 from `--seed`) in one no-grad forward, twice: as the builder
computes them (its float32 log-softmax) and with the engine's sampler op over the same logits
(fixtures.vllm.trainer_ops.VLLMOps.token_logprobs: the V1 / V2 runner's arithmetic), so a
difference in the sampler op alone shows as such. Then the engine: a VLLMEngine with
VLLM_BATCH_INVARIANT=1 and the fix pack (`--fixes`, default all), whose prompt logprobs of the
same sequences (VLLMEngine.prompt_logprobs, C7's prefill side) are compared bitwise; and, for
qwen3 / qwen3_moe / llama, the hand-written EngineKernelTrainer (the `--impl
vllm-engine-kernels` trainer, known to match the engine there). The module-built model is closed
before the engine starts (the engine's memory profile sees the GPU free), the engine before the
hand-written trainer is built.

    python benchmarks/module_trainer_gpu.py --model qwen3 --model qwen3_moe --model llama
    ... --model qwen3 --proxy full --sequences 16 --json /tmp/module_trainer.json
    ... --model qwen2,gemma3_text,mixtral,deepseek_v3      # families: the n/a list is the answer

Prints a markdown table and, for each difference, its detail (fixtures.core.comparison); exits 0
even where values differ (a measurement), 2 on bad arguments (one line). GPU and vLLM 0.26 only;
tests_meta/test_module_trainer_benchmark.py runs its arguments and table on the CPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HAND_WRITTEN = ("qwen3", "qwen3_moe", "llama")     # fixtures.vllm.trainer.SUPPORTED (checked again when built)
MIN_LEN, MAX_LEN = 16, 600


class _Parser(argparse.ArgumentParser):
    def error(self, message):       # one line, not argparse's usage + message
        raise ValueError(message)


def parse_args(argv) -> argparse.Namespace:
    """The arguments, checked: ValueError (one line) on anything wrong."""
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=None,
                    help="a recipe or family name or a model directory; repeatable or comma-separated")
    ap.add_argument("--proxy", default="shallow", choices=("shallow", "full"))
    ap.add_argument("--sequences", type=int, default=64, help=f"how many (lengths {MIN_LEN}..{MAX_LEN})")
    ap.add_argument("--seed", type=int, default=0, help="the lengths' and tokens' seed")
    ap.add_argument("--fixes", default="all", help="the engine's and trainer's fix pack (--vllm-fixes spelling)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    from fixtures.models.proxies import config_dir, read_config_json, resolve_model
    from fixtures.vllm.fixes import parse
    names = [n.strip() for m in (args.model or ["qwen3"]) for n in m.split(",") if n.strip()]
    if not names:
        raise ValueError("--model: expected a recipe or family name or a model directory")
    args.models = []
    for n in names:
        resolved = resolve_model(n)
        read_config_json(config_dir(resolved), "--model")     # ProxyError (a ValueError) if unusable
        args.models.append((n, resolved))
    if args.sequences < 1:
        raise ValueError("--sequences: expected a whole number >= 1")
    parse(args.fixes)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise ValueError(f"--json {args.json}: its directory does not exist")
    return args


def set_environment(fixes: str) -> None:
    """Before vLLM is imported: VLLM_BATCH_INVARIANT=1 (vLLM picks its kernel configurations from it;
    VLLMOps refuses without it), the fix pack for the engine workers and this process, and what
    the fixes need before CUDA starts (VLLMImplementation.process_environment's)."""
    from fixtures.vllm.fixes import FIXES_ENV, parse, process_env
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ[FIXES_ENV] = fixes
    os.environ.update(process_env(parse(fixes), batch_invariant=True))


def sequences(n: int, vocab: int, seed: int) -> list[list[int]]:
    """n token sequences, lengths uniform in MIN_LEN..MAX_LEN, tokens uniform in the vocabulary."""
    import torch
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


# ---------------------------------------------------------------------------------------------
# the measurement (GPU)
# ---------------------------------------------------------------------------------------------
def _free_gpu() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> str:
    line = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    print(traceback.format_exc(), file=sys.stderr, flush=True)
    return line


def _diff(mine, theirs, lhs: str, rhs: str) -> dict:
    """compare() as a JSON-able dict, with format_difference's text where they differ."""
    from fixtures.core.comparison import compare, format_difference
    d = compare(mine, theirs, what="logprobs", lhs_name=lhs, rhs_name=rhs)
    out = {"equal": d.equal, "differing": d.count, "total": d.total, "structural": d.structural,
           "first": list(d.first) if d.first else None, "lhs_value": d.lhs_value, "rhs_value": d.rhs_value,
           "lhs_hex": d.lhs_hex, "rhs_hex": d.rhs_hex, "ulp": d.ulp, "max_abs": d.max_abs}
    if not d.equal:
        out["detail"] = format_difference(d, context="")
    return out


def measure_model(name: str, resolved: str, args, tmp: Path) -> dict:
    """One model's row (see the module docstring); every failure is recorded, never raised."""
    import torch
    from fixtures.models.proxies import build_proxy
    r: dict = {"model": name, "proxy": args.proxy, "times_s": {}, "wrapped": {}, "na": [], "error": None}
    t = r["times_s"]
    t0 = time.perf_counter()
    try:
        path = build_proxy(resolved, args.proxy, tmp / name.replace("/", "_"), dtype=torch.bfloat16).path
    except Exception as exc:
        r["error"] = "proxy: " + _error(exc)
        return r
    t["proxy"] = time.perf_counter() - t0
    config = json.loads((path / "config.json").read_text())
    r["family"] = config.get("model_type", "?")
    seqs = sequences(args.sequences, int(config["vocab_size"]), args.seed)
    r["tokens"] = sum(len(s) - 1 for s in seqs)

    # (1) the module-built forward
    from fixtures.vllm.module_trainer import ModuleBuiltModel
    mm = None
    try:
        t0 = time.perf_counter()
        mm = ModuleBuiltModel(path, seed=args.seed, require_known=False)
        t["module_build"] = time.perf_counter() - t0
        for op in mm.wrapped.wrapped.values():
            r["wrapped"][op] = r["wrapped"].get(op, 0) + 1
        r["na"] = [{"path": u.path, "class": u.cls, "why": u.why} for u in mm.wrapped.unknown]
        if r["na"]:
            return r
        from fixtures.vllm.fixes import install, selected
        r["fixes_in_trainer"] = install(selected(), where="trainer")
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mine = [x.float().cpu() for x in mm.token_logprobs(seqs)]
            torch.cuda.synchronize()
            t["module_forward"] = time.perf_counter() - t0
            try:
                from fixtures.vllm.trainer_ops import VLLMOps
                ops = VLLMOps(mm.hf_config)
                r["sampler"] = ops.sampler
                logits, start, with_sampler = mm.logits(seqs), 0, []
                for s in seqs:
                    tg = torch.tensor(s[1:], dtype=torch.long, device=logits.device)
                    with_sampler.append(ops.token_logprobs(logits[start:start + len(s) - 1], tg).float().cpu())
                    start += len(s)
                del logits
            except Exception as exc:
                with_sampler, r["sampler_error"] = None, _error(exc)
    except Exception as exc:
        r["error"] = "module-built: " + _error(exc)
        return r
    finally:
        if mm is not None:
            mm.close()
            del mm
        _free_gpu()

    # (2) the engine's prompt logprobs
    from fixtures.core.contract import EngineSettings
    from fixtures.vllm.client import VLLMEngine
    try:
        t0 = time.perf_counter()
        engine = VLLMEngine(path, EngineSettings(batch_invariant=True,
                                                 extra={"env": {"CONFORMANCE_VLLM_FIXES": args.fixes}}))
        t["engine_start"] = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            theirs = [x.float().cpu() for x in engine.prompt_logprobs(seqs)]
            t["engine_prompt_logprobs"] = time.perf_counter() - t0
        finally:
            engine.close()
        r["engine"] = _diff(mine, theirs, "module-built", "engine")
        if with_sampler is not None:
            r["engine_sampler_op"] = _diff(with_sampler, theirs, "module-built + engine sampler op", "engine")
    except Exception as exc:
        r["error"] = "engine: " + _error(exc)
        theirs = None
    _free_gpu()

    # (3) the hand-written trainer, where it exists
    if r["family"] not in HAND_WRITTEN:
        r["hand_written"] = f"n/a: {r['family']} (hand-written for {', '.join(HAND_WRITTEN)})"
        return r
    try:
        from functools import partial
        from fixtures.core.contract import Layout
        from fixtures.vllm.trainer import EngineKernelTrainer
        from fixtures.vllm.trainer_ops import VLLMOps
        t0 = time.perf_counter()
        trainer = EngineKernelTrainer(path, partial(VLLMOps, model_impl="native"), dtype=torch.bfloat16, device="cuda")
        try:
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            hand = [x.float().cpu() for x in trainer.logprobs(seqs, layout=Layout.PACKED)]
            torch.cuda.synchronize()
            t["hand_written"] = time.perf_counter() - t1
            t["hand_written_build"] = t1 - t0
        finally:
            del trainer
            _free_gpu()
        r["hand_written"] = _diff(mine, hand, "module-built", "hand-written")
        if theirs is not None:
            r["hand_written_vs_engine"] = _diff(hand, theirs, "hand-written", "engine")
    except NotImplementedError as exc:
        r["hand_written"] = str(exc).splitlines()[0]
    except Exception as exc:
        r["hand_written"] = "error: " + _error(exc)
    return r


# ---------------------------------------------------------------------------------------------
# the report (pure: tests_meta runs it on fake results)
# ---------------------------------------------------------------------------------------------
def cell(d) -> str:
    """One comparison's cell: `yes (N)`, or the count and the first difference in hex and ULP."""
    if d is None:
        return "-"
    if isinstance(d, str):
        return d
    if d.get("structural"):
        return f"no: {d['structural']}"
    if d["equal"]:
        return f"yes ({d['total']:,})"
    s, tok = d["first"]
    return (f"no: {d['differing']:,} of {d['total']:,} differ; first at ({s}, {tok}): "
            f"{d['lhs_hex']} vs {d['rhs_hex']} ({d['ulp']} ULP)")


def table(results: list[dict]) -> str:
    """The markdown table, then each difference's detail and each n/a layer."""
    lines = ["| model | family | layers wrapped by kind | n/a layers | tokens | module-built = engine | "
             "+ engine sampler op = engine | = hand-written (hand-written = engine) | time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    details = []
    for r in results:
        wrapped = ", ".join(f"{op} {n}" for op, n in sorted(r.get("wrapped", {}).items())) or "-"
        na = len(r.get("na", []))
        if r.get("error"):
            eq = f"error: {r['error']}"
        elif na:
            eq = "not run (n/a layers)"
        else:
            eq = cell(r.get("engine"))
        hand = cell(r.get("hand_written"))
        if isinstance(r.get("hand_written_vs_engine"), dict):
            hand += f" ({cell(r['hand_written_vs_engine'])})"
        sampler = cell(r.get("engine_sampler_op")) if "engine_sampler_op" in r else \
            (f"error: {r['sampler_error']}" if r.get("sampler_error") else "-")
        if r.get("sampler"):
            sampler += f" [{r['sampler']}]"
        times = ", ".join(f"{k} {v:.1f}" for k, v in r.get("times_s", {}).items()) or "-"
        lines.append(f"| {r['model']} ({r.get('proxy', '?')}) | {r.get('family', '?')} | {wrapped} | "
                     f"{na or '-'} | {r.get('tokens', 0):,} | {eq} | {sampler} | {hand} | {times} |")
        for u in r.get("na", []):
            details.append(f"{r['model']}: n/a: {u['path'] or '<root>'} is a {u['class']}: {u['why']}")
        for key in ("engine", "engine_sampler_op", "hand_written", "hand_written_vs_engine"):
            d = r.get(key)
            if isinstance(d, dict) and d.get("detail"):
                details.append(f"{r['model']}: " + d["detail"].rstrip())
    return "\n".join(lines + ([""] + details if details else []))


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as exc:
        msg = (str(exc) or repr(exc)).splitlines()[0]
        print(f"error: {msg}", file=sys.stderr)
        return 2
    set_environment(args.fixes)          # before anything imports vLLM
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, resolved in args.models:
            r = measure_model(name, resolved, args, Path(tmp))
            results.append(r)
            # each model's row and the JSON as soon as it is measured: a run killed later keeps them
            # (on 2026-12-06 a hang in the third model lost the first two's numbers)
            print(f"{name}: done ({r.get('error') or ('n/a layers' if r.get('na') else 'measured')})\n"
                  f"{table([r])}", file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
