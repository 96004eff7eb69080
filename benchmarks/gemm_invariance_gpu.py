"""TFLOP/s and row invariance of three GEMMs per (M, N, K) (issue #48): stock cuBLAS, vLLM's
batch-invariant persistent Triton GEMM (vllm.model_executor.layers.batch_invariant.matmul_persistent)
and cuBLASLt with CUBLAS_WORKSPACE_CONFIG=:16:8 and CUBLASLT_WORKSPACE_SIZE=1 (the `cublaslt` fix,
docs/vllm-fixes.md). Each GEMM runs in a subprocess of its own, its environment set before CUDA
starts (cuBLAS reads those settings once). Row-invariant: every row of each M-row call equals that
row alone and in the largest call (fixtures.vllm.gemm_rows, the C2 check's arithmetic).

    python benchmarks/gemm_invariance_gpu.py --shapes-from qwen3                 # the proxy config's projections + LM head
    python benchmarks/gemm_invariance_gpu.py --shapes 4096x4096,128x4096 --sizes 1,256,8192
    python benchmarks/gemm_invariance_gpu.py --shapes-from qwen3 --no-rows       # speed only

Not run on a GPU yet (written on a CPU-only machine). Prints a markdown table; exits 0, 2 on bad
arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GEMMS = {   # name -> (environment before CUDA, torch BLAS library, what it is)
    "stock cuBLAS": ({}, None, "torch.mm, torch's default BLAS choice, no workspace settings"),
    "vLLM batch-invariant": ({}, None, "vLLM's matmul_persistent (Triton)"),
    "cuBLASLt + settings": ({"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}, "cublaslt",
                            "torch.mm on cuBLASLt, split-K held off by the workspace settings"),
}
DEFAULT_SIZES = (1, 7, 64, 255, 256, 257, 1024, 4096, 8192, 16384)


def shapes_from(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of the model's projections and LM head, from its proxy config (widths only)."""
    from fixtures.models.proxies import proxy_config, source_config
    from fixtures.vllm.gemm_rows import gemm_shapes
    from fixtures.vllm.kernel_cases import dims_from_config
    return gemm_shapes(dims_from_config(proxy_config(source_config(model), "shallow").to_dict()))


def child(name: str, shapes, sizes, rows: bool, iters: int) -> dict:
    """In the subprocess: time each (M, N, K) with CUDA events (median of `iters` after a warm-up)
    and, with `rows`, run the row check per shape."""
    import torch
    _, blas, _ = GEMMS[name]
    if blas:
        torch.backends.cuda.preferred_blas_library(blas)
    if name == "vLLM batch-invariant":
        from vllm.model_executor.layers.batch_invariant import matmul_persistent
        mm = lambda x, w: matmul_persistent(x, w.t())
    else:
        mm = lambda x, w: x @ w.t()
    from fixtures.vllm.gemm_rows import GemmRows
    dev, out = torch.device("cuda"), {"speed": {}, "rows": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for sname, N, K in shapes:
        w = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        x = torch.randn(max(sizes), K, generator=g, device=dev).to(torch.bfloat16)
        for M in sizes:
            a = x[:M]
            for _ in range(3):
                mm(a, w)
            times = []
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                mm(a, w)
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / 1e3)
            sec = sorted(times)[len(times) // 2]
            out["speed"][f"{M}x{N}x{K}"] = 2 * M * N * K / sec / 1e12
        del x, w
        if rows:
            gr = GemmRows(mm, lambda seed, M, N_, K_: (
                torch.randn(M, K_, generator=g, device=dev).to(torch.bfloat16),
                (torch.randn(N_, K_, generator=g, device=dev) * 0.02).to(torch.bfloat16)), sync=torch.cuda.synchronize)
            with torch.no_grad():
                res = gr.run([(sname, N, K)], sizes)[sname]
            out["rows"][sname] = {"alone_differing": res["alone_differing"],
                                  "differing": {str(M): n for M, n in res["differing"].items()},
                                  "rerun_same": all(v is None for v in res["rerun"].values())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes-from", metavar="MODEL", help="a recipe name: its projections and LM head")
    ap.add_argument("--shapes", help="NxK,... (output width x contraction)")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="row counts M, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-rows", action="store_true", help="speed only, no row check")
    ap.add_argument("--gemms", default=",".join(GEMMS), help="which GEMMs, comma-separated")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
        if args.shapes:
            shapes = [(s, *map(int, s.split("x"))) for s in args.shapes.split(",")]
        else:
            shapes = shapes_from(args.shapes_from or "qwen3")
        names = [n.strip() for n in args.gemms.split(",")]
        assert sizes and sizes[0] >= 1 and all(n in GEMMS for n in names) and args.iters >= 1
    except (ValueError, AssertionError, TypeError) as exc:
        print(f"bad arguments: {exc or 'see --help'}", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(child(args.child, shapes, sizes, not args.no_rows, args.iters)))
        return 0
    results = {}
    for name in names:
        env = {**{k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")},
               **GEMMS[name][0], "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--child", name, "--shapes", ",".join(f"{N}x{K}" for _, N, K in shapes),
               "--sizes", ",".join(map(str, sizes)), "--iters", str(args.iters)] + (["--no-rows"] if args.no_rows else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            print(f"{name}: failed ({p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(p.stdout.strip().splitlines()[-1])
    print("| M | N | K | " + " | ".join(f"{n} TFLOP/s" for n in results) + " |")
    print("|---|---|---|" + "---|" * len(results))
    for sname, N, K in shapes:
        for M in sizes:
            key = f"{M}x{N}x{K}"
            print(f"| {M} | {N} | {K} | " + " | ".join(f"{r['speed'][key]:.0f}" for r in results.values()) + " |")
    if not args.no_rows:
        print("\n| shape | " + " | ".join(f"{n} row-invariant" for n in results) + " |")
        print("|---|" + "---|" * len(results))
        for sname, N, K in shapes:
            cells = []
            for r in results.values():
                row = r["rows"].get(f"{N}x{K}") or {}
                bad = {M: n for M, n in row.get("differing", {}).items() if n}
                ok = not bad and not row.get("alone_differing") and row.get("rerun_same")
                cells.append("yes" if ok else f"no ({row.get('alone_differing')} rows differ alone; "
                             f"from the largest: {bad or 'none'})")
            print(f"| {N}x{K} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
