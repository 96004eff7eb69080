"""Where a compiled vLLM engine leaves eager's arithmetic (issue #21, C5 "compiled vs eager").

Module outputs cannot localise a compiled engine (no module hook runs inside a compiled graph), so
this bisects by configuration instead, the way torch's own compiler bisector does: the same
sequences' prompt logprobs (no sampling: every position of every sequence is compared) on an
eager engine and on compiled engines that each drop one stage or one numerics knob:

    compiled (C5)             the configuration C5 compares (with --vllm-fixes: the compiled fix)
    dynamo only               compilation_config.backend = "eager": traced and split, no inductor
    inductor, no emulate      emulate_precision_casts off (the compiled fix turns it on)
    inductor, div_rn          + TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1 (x / y as eager rounds it)

The first variant equal to eager names the stage that differs: dynamo-only equal and the others
not means inductor's generated code; dynamo-only different means the traced graph itself (an op
replaced while tracing, a specialised constant). `--dump DIR` keeps the worker logs, where the
first compiled engine writes inductor's generated code (TORCH_LOGS=output_code) for reading.

    VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/compiled_bisect_gpu.py --model qwen3 --proxy shallow --dump out
    ... --fake echo                               # the script itself, on the CPU

Prints one markdown table and exits 0; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = (
    ("compiled (C5)", {}, {"TORCH_LOGS": "output_code"}),     # inductor's kernels into the worker log
    ("dynamo only (backend eager)", {"backend": "eager"}, {}),
    ("inductor, emulate_precision_casts off", {"inductor_compile_config": {"emulate_precision_casts": False}}, {}),
    ("inductor, division rounded as eager", {}, {"TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING": "1"}),
)


def sequences(vocab: int) -> list[list[int]]:
    """Prompts of 1 ... 300 tokens, one past 256 (where vLLM's stock fused norm changes launch)."""
    from fixtures.checks.workloads import random_ids
    return [list(random_ids(vocab, n, seed=900 + n)) for n in (2, 7, 16, 33, 64, 129, 300)]


def compare(want, got) -> str:
    import torch
    from fixtures.core.comparison import float_hex, ulp_distance
    differing, total, worst, first = 0, 0, 0, None
    for i, (a, b) in enumerate(zip(want, got)):
        a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        total += a.numel()
        bad = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        if bad.any():
            differing += int(bad.sum())
            worst = max(worst, int(ulp_distance(a[bad], b[bad]).max()))
            if first is None:
                j = int(bad.nonzero()[0])
                first = f"seq {i} (len {a.numel() + 1}) pos {j}: {float_hex(a[j])} vs {float_hex(b[j])}"
    if not differing:
        return f"equal ({total} positions)"
    return f"**{differing} of {total} differ**, max {worst} ULP; first {first}"


def run(path: Path, *, fake: str | None, fixes: str, dump: Path | None) -> list[tuple[str, str, str]]:
    import json
    from fixtures.core.contract import EngineSettings
    from fixtures.vllm.client import VLLMEngine
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    seqs = sequences(vocab)
    base_env = {"CONFORMANCE_VLLM_FIXES": fixes}

    def logprobs(settings: EngineSettings):
        engine = VLLMEngine(path, settings, fake=fake, log_dir=dump)
        try:
            out = engine.prompt_logprobs(seqs)
            return out, str(((engine.info or {}).get("vllm_fixes") or {}).get("compiled", ""))
        finally:
            engine.close()

    want, fixes_eager = logprobs(EngineSettings(compilation=False, cuda_graphs=False, extra={"env": base_env}))
    rows = [("eager (reference)", "-", f"compiled fix: {fixes_eager}")]
    for label, cc, env in VARIANTS:
        cc = dict(cc)       # (vLLM's debug_dump_path would need depyf, which its wheel does not pull in)
        settings = EngineSettings(compilation=True, cuda_graphs=False,
                                  extra={"env": {**base_env, **env}, "llm_kwargs": {"compilation_config": cc}})
        try:
            got, status = logprobs(settings)
            rows.append((label, compare(want, got), f"compiled fix: {status}"))
        except Exception as exc:       # one variant that cannot start must not hide the others
            rows.append((label, f"did not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", ""))
    return rows


def main(argv=None) -> int:
    from benchmarks.c10_side_by_side_gpu import add_model_arguments, model_dir
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--fixes", default="all", help="--vllm-fixes spelling, for every engine here")
    ap.add_argument("--dump", default=None, help="a folder for vLLM's compile dumps and the worker logs")
    args = ap.parse_args(argv)
    from fixtures.vllm.fixes import parse
    try:
        parse(args.fixes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dump = Path(args.dump).resolve() if args.dump else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(model_dir(args, Path(tmp)), fake=args.fake, fixes=args.fixes, dump=dump)
    print("| engine | prompt logprobs vs eager | start info |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(r.replace("|", "/") for r in row) + " |")
    if dump is not None:
        shutil.make_archive(str(dump), "gztar", root_dir=dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
