#!/usr/bin/env python3
"""The host time of one attention call from Python against the C++ call, kernels cached (issue
13): a tiny causal problem (B 1, H 1, 128 x 128, D 64) whose kernel takes less GPU time than
the call takes host time. Each run times --calls calls back to back (fewer than the launch queue
holds, so the host never waits for the GPU), then synchronizes; the median of --reps runs, in
microseconds per call.

    python3 tools/bench_python_overhead.py --cpp build-release/bench_call_overhead

Rows: the C++ flexc::attention (bench_call_overhead), flexc.attention on torch tensors (DLPack,
outputs given), flexc.torch.flex_attention (allocates out and LSE, like FlexAttention) without
and with autograd recording, and for reference torch.compile(flex_attention) and SDPA.
"""
import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import flexc
import flexc.torch as ft


def per_call_us(fn, calls, reps):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpp", required=True, help="the bench_call_overhead executable")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--reps", type=int, default=41)
    args = ap.parse_args()

    cpp = json.loads(subprocess.run([args.cpp, "--json", "--calls", str(args.calls), "--reps",
                                     str(args.reps)], check=True, capture_output=True,
                                    text=True).stdout)["cpp_attention_us"]
    L, D = 128, 64
    q, k, v = (torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 1, L, device="cuda")
    causal = flexc.Variant.from_catalogue("causal")
    mask = flexc.create_block_mask(causal, 1, 1, L, L)
    stream = torch.cuda.current_stream().cuda_stream
    tmask = ft.create_block_mask("q_idx >= kv_idx", None, None, L, L)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch_mask = torch_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L)
    compiled = torch.compile(torch_flex)

    rows = [("C++ flexc::attention", cpp)]
    timed = [
        ("flexc.attention (DLPack, outputs given)",
         lambda: flexc.attention(q, k, v, out, causal, block_mask=mask, lse=lse, stream=stream)),
        ("flexc.torch.flex_attention", lambda: ft.flex_attention(q, k, v, block_mask=tmask)),
        ("flexc.torch.flex_attention, autograd recording",
         lambda: ft.flex_attention(qg, kg, vg, block_mask=tmask)),
        ("torch.compile(flex_attention)", lambda: compiled(q, k, v, block_mask=torch_mask)),
        ("SDPA (is_causal)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    ]
    print(f"host time per call, kernels cached, {L}x{L} D{D} causal "
          f"(median of {args.reps} runs of {args.calls} calls)")
    print(f"{'call':<48} {'us':>8} {'over C++':>9}")
    print(f"{rows[0][0]:<48} {cpp:8.2f}")
    for name, fn in timed:
        rows.append((name, per_call_us(fn, args.calls, args.reps)))
        print(f"{name:<48} {rows[-1][1]:8.2f} {rows[-1][1] - cpp:+9.2f}", flush=True)
    print(json.dumps({name: round(us, 3) for name, us in rows}))


if __name__ == "__main__":
    main()
