"""CPU benchmark: each batch-invariant kernel (fixtures.reference.kernels) vs the stock torch op.

Not a test. Sizes are those of the tiny proxies (hidden 64, vocab 512, tens of tokens, batches of
8) plus a larger row count. Prints a Markdown table: median time per call over `--repeat` runs,
and the slowdown (kernel / stock).

    python benchmarks/kernels_cpu.py [--threads 1] [--repeat 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixtures.reference import kernels as K  # noqa: E402

aten = torch.ops.aten


def timed(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cases(g: torch.Generator):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = []
    for m in (1, 40, 320, 1024):
        x, w = r(m, 64), r(64, 512)
        out.append((f"matmul [{m}x64]@[64x512]", lambda x=x, w=w: K.matmul(x, w), lambda x=x, w=w: x @ w))
    a, b = r(32, 40, 16), r(32, 16, 40)
    out.append(("matmul bmm [32x40x16]@[32x16x40] (scores)", lambda: K.matmul(a, b), lambda: torch.bmm(a, b)))
    p, v = r(32, 40, 40).softmax(-1), r(32, 40, 16)
    out.append(("matmul bmm [32x40x40]@[32x40x16] (P@V)", lambda: K.matmul(p, v), lambda: torch.bmm(p, v)))
    xg, wg = r(640, 64), r(4, 64, 128)
    offs = torch.tensor([100, 300, 420, 640], dtype=torch.int32)
    out.append(("grouped_matmul [640x64] x 4 experts [64x128]", lambda: K.grouped_matmul(xg, wg, offs),
                lambda: torch._grouped_mm(xg, wg, offs=offs)))
    lg = r(320, 512)
    out.append(("softmax [320x512]", lambda: K.softmax(lg, -1), lambda: torch.softmax(lg, -1)))
    out.append(("log_softmax [320x512]", lambda: K.log_softmax(lg, -1), lambda: torch.log_softmax(lg, -1)))
    sc = r(32, 40, 40)
    out.append(("softmax [32x40x40] (attention)", lambda: K.softmax(sc, -1), lambda: torch.softmax(sc, -1)))
    gr, y = r(320, 512), lg.log_softmax(-1)
    out.append(("log_softmax_backward [320x512]", lambda: K.log_softmax_backward(gr, y, -1),
                lambda: aten._log_softmax_backward_data(gr, y, -1, torch.float32)))
    h = r(320, 64)
    out.append(("mean [320x64] (RMSNorm)", lambda: K.mean(h, [-1], True), lambda: h.mean(-1, keepdim=True)))
    out.append(("sum [320x64] over tokens", lambda: K.reduce_sum(h, [0]), lambda: h.sum(0)))
    cs = r(8, 8, 4, 8)
    out.append(("cumsum [8x8x4x8] (Mamba chunk)", lambda: K.cumsum(cs, -1), lambda: torch.cumsum(cs, -1)))
    out.append(("logsumexp [320x512]", lambda: K.logsumexp(lg, [-1]), lambda: torch.logsumexp(lg, -1)))
    idx = torch.randint(0, 512, (320,), generator=g)
    out.append(("embedding_backward 320 tokens, vocab 512", lambda: K.embedding_backward(h, idx, 512),
                lambda: aten.embedding_dense_backward(h, idx, 512, -1, False)))
    xc, wc, bc = r(8, 192, 40), r(192, 1, 4), r(192)
    out.append(("conv1d depthwise [8x192x40] k=4", lambda: K.conv1d(xc, wc, bc, 1, 3, 1, 192),
                lambda: F.conv1d(xc, wc, bc, 1, 3, 1, 192)))
    go = r(8, 192, 43)
    out.append(("conv1d_backward [8x192x40] k=4", lambda: K.conv1d_backward(go, xc, wc, [192], 1, 3, 1, 192),
                lambda: aten.convolution_backward(go, xc, wc, [192], [1], [3], [1], False, [0], 192, [True] * 3)))
    q, k, vv = r(8, 4, 40, 16), r(8, 2, 40, 16), r(8, 2, 40, 16)
    out.append(("attention prefill B8 H4/2 S40 D16", lambda: K.attention(q, k, vv),
                lambda: F.scaled_dot_product_attention(q, k, vv, is_causal=True, enable_gqa=True)))
    q1 = q[:, :, -1:]
    out.append(("attention decode B8 H4/2 S40 D16", lambda: K.attention(q1, k, vv),
                lambda: F.scaled_dot_product_attention(q1, k, vv, enable_gqa=True)))
    act = r(320, 128)
    out.append(("silu [320x128]", lambda: K.silu(act), lambda: F.silu(act)))
    out.append(("silu_backward [320x128]", lambda: K.silu_backward(act, act), lambda: aten.silu_backward(act, act)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the suite's CPU lane uses 1)")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); "
          f"tile {K.TILE_ROWS['cpu']} rows, KV block {K.KV_BLOCK['cpu']}, median of {args.repeat}\n")
    print("| kernel (shape) | invariant (ms) | stock (ms) | slowdown |")
    print("|---|---:|---:|---:|")
    with torch.no_grad():
        for name, mine, stock in cases(g):
            tm, ts = timed(mine, args.repeat), timed(stock, args.repeat)
            print(f"| {name} | {tm * 1e3:.3f} | {ts * 1e3:.3f} | {tm / ts:.1f}x |")


if __name__ == "__main__":
    main()
