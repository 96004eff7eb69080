"""GPU smoke test and benchmark of the fix pack (fixtures.vllm.fixes; not a test of the suite):
vLLM 0.26's stock kernels against the fixes at the real widths, every row of every size, then the
speed of each pair.

    VLLM_BATCH_INVARIANT=1 python benchmarks/vllm_fixes_gpu.py [--hidden 4096,2048] [--vocab 151936]

Checks (exit status 1 if a fix check fails; the stock rows are reported, not judged):
- fused add + RMSNorm: every row of an M-token call equals that row alone, M in 1 ... 8192; in place
  as vLLM's op (residual = bf16(x + r)); reached through vLLM's RMSNorm.forward_cuda once
  installed; and (reported) equal to vLLM's batch-invariant RMSNorm of the rounded sum;
- the sampler's softmax (logits.softmax(-1, dtype=float32) under vLLM's override): rows vs alone;
- speed: device time per call from a CUDA-graph replay (launch overhead excluded) and eager time
  per call, fix / stock; the stated bound is RATIO on device time for M >= 64.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RATIO = 1.5          # stated bound: fixed / stock device time, M >= 64 tokens
SIZES = (1, 2, 7, 16, 44, 64, 255, 256, 257, 1024, 2048, 4096, 8192)


def rows_differing(fn, inputs, M):
    import torch
    batch = fn(*(t[:M] for t in inputs))
    alone = torch.cat([fn(*(t[i:i + 1] for t in inputs)) for i in range(M)])
    return int((batch != alone).reshape(M, -1).any(dim=1).sum())


def device_us(fn, iters=50):
    """Device time per call of fn() from a CUDA graph of `iters` calls (no launch overhead)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iters)


def eager_us(fn, iters=200):
    import time
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="4096,2048")
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        print("set VLLM_BATCH_INVARIANT=1 (the fixes are drop-ins for vLLM's batch-invariant mode)")
        return 2
    import torch
    import vllm
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance, rms_norm_batch_invariant
    from fixtures.vllm import fixed_kernels as FK
    from fixtures.vllm import fixes as FX
    init_batch_invariance()
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    for name, fix in FX.FIXES.items():
        print(f"needed {name}: {fix.needed()}")
    bad: list[str] = []
    dev, eps = "cuda", 1e-6
    g = torch.Generator(device=dev).manual_seed(0)

    # ---- fused add + RMSNorm ------------------------------------------------------------------
    for H in (int(h) for h in args.hidden.split(",")):
        n = max(SIZES)
        x = torch.randn(n, H, device=dev, generator=g).bfloat16()
        r = torch.randn(n, H, device=dev, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).bfloat16()

        def stock(a, b):
            a, b = a.clone(), b.clone()
            ops.fused_add_rms_norm(a, b, w, eps)
            return torch.cat([a, b], -1)

        def fixed(a, b):
            a, b = a.clone(), b.clone()
            FK.fused_add_rms_norm(a, b, w, eps)
            return torch.cat([a, b], -1)
        for M in SIZES:
            s_bad, f_bad = rows_differing(stock, (x, r), M), rows_differing(fixed, (x, r), M)
            print(f"fused_add_rms_norm H={H} M={M}: rows differing from alone, stock {s_bad}, fixed {f_bad}")
            if f_bad:
                bad.append(f"fused_add_rms_norm H={H} M={M}: {f_bad} rows differ with the fix")
        a, b = x[:300].clone(), r[:300].clone()
        FK.fused_add_rms_norm(a, b, w, eps)
        if not torch.equal(b, (x[:300].float() + r[:300].float()).bfloat16()):
            bad.append(f"H={H}: the residual is not bf16(x + r)")
        same = torch.equal(a, rms_norm_batch_invariant(b, w, eps))
        print(f"H={H}: fixed == vLLM's batch-invariant RMSNorm of the rounded sum: {same} (reported, not judged)")
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.layernorm import RMSNorm
        with set_current_vllm_config(VllmConfig()):
            norm = RMSNorm(H, eps=eps).to(device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(w)
        FX.activate(("fused_add_rms_norm",))
        via_layer = norm.forward_cuda(x[:300].clone(), r[:300].clone())[0]
        FX.activate(())
        if not torch.equal(via_layer, a):
            bad.append(f"H={H}: RMSNorm.forward_cuda(x, r) with the fix installed is not the fixed kernel")
        for M in (1, 64, 256, 1024, 4096, 8192):
            xa, ra = x[:M].clone(), r[:M].clone()
            st_d = device_us(lambda: ops.fused_add_rms_norm(xa, ra, w, eps))
            fx_d = device_us(lambda: FK.fused_add_rms_norm(xa, ra, w, eps))
            st_e = eager_us(lambda: ops.fused_add_rms_norm(xa, ra, w, eps))
            fx_e = eager_us(lambda: FK.fused_add_rms_norm(xa, ra, w, eps))
            print(f"speed H={H} M={M}: device {st_d:.2f} / {fx_d:.2f} us (fixed/stock {fx_d / st_d:.2f}x); "
                  f"eager {st_e:.1f} / {fx_e:.1f} us ({fx_e / st_e:.2f}x)")
            if M >= 64 and fx_d / st_d > RATIO:
                bad.append(f"H={H} M={M}: fixed kernel {fx_d / st_d:.2f}x the stock device time (bound {RATIO}x)")

    # ---- the sampler's softmax ----------------------------------------------------------------
    logits = 3 * torch.randn(256, args.vocab, device=dev, generator=g)
    sm = lambda t: t.softmax(dim=-1, dtype=torch.float32)        # noqa: E731 - as the V1 sampler calls it
    for M in (1, 2, 7, 16, 64, 256):
        s_bad = rows_differing(sm, (logits,), M)
        FX.activate(("sampler_sum",))
        f_bad = rows_differing(sm, (logits,), M)
        FX.activate(())
        print(f"sampler softmax V={args.vocab} M={M}: rows differing from alone, stock {s_bad}, fixed {f_bad}")
        if f_bad:
            bad.append(f"sampler softmax M={M}: {f_bad} rows differ with the fix")
    for M in (1, 64, 256):
        st = device_us(lambda: sm(logits[:M]))
        FX.activate(("sampler_sum",))
        fx = device_us(lambda: sm(logits[:M]))
        FX.activate(())
        print(f"speed sampler softmax M={M}: device {st:.1f} / {fx:.1f} us ({fx / st:.2f}x; reported)")
    print("FAIL:\n  " + "\n  ".join(bad) if bad else "OK: every fixed kernel gives every row its bits alone")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
