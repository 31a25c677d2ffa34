#!/usr/bin/env python3
"""Gated linear attention: flexc against flash-linear-attention and softmax attention, same run.

Runs flexc's tools/bench_linear --json, then on each of its forward shapes (B, T, H, D, bf16):
flash-linear-attention's Triton kernels on the same gates (chunk_gla for gates per key dim,
chunk_simple_gla for one gate per step or none; layout [B, T, H, D], float32 gates), and
softmax attention with a causal mask through SDPA's FlashAttention-2 and cuDNN backends. For the
step: fla's fused_recurrent_gla on one token, and a device copy of 2 GiB (read + write bandwidth,
what a kernel that reads and writes the state once can reach).

    python3 tools/bench_linear_peers.py --flexc "build/bench_linear --json"

fla comes from PyPI (flash-linear-attention, fla-core, einops; README "GPU machine" says how to
carry the wheels). Columns are ms per call (CUDA events, 5 back-to-back calls per run, warm-up,
median of --reps) and time ratios: x fla = fla's time / flexc's.
"""
import argparse
import json
import shlex
import subprocess

import bench_peers  # tools/, beside this script
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, reps):
    return bench_peers.time_ms(fn, reps, inner=5, warmup=3)


def fla_forward(r, reps):
    """fla on the case's shape and gate kind, or None when fla is not installed."""
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        print(f"# fla not available: {e}")
        return None
    b, t, h, d = r["b"], r["t"], r["h"], r["d"]
    dev = "cuda"
    q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    if r["step"]:
        g = F.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16
        state = torch.zeros(b, h, d, d, device=dev, dtype=torch.float32)
        return time_ms(lambda: fused_recurrent_gla(q, k, v, gk=g, initial_state=state,
                                                   output_final_state=True), reps)
    if r["gates"] == "dim":
        g = F.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16
        return time_ms(lambda: chunk_gla(q, k, v, g), reps)
    g = F.logsigmoid(torch.randn(b, t, h, device=dev)) / 16 if r["gates"] == "step" else None
    return time_ms(lambda: chunk_simple_gla(q, k, v, g=g), reps)


def sdpa_causal(r, backend, reps):
    b, t, h, d = r["b"], r["t"], r["h"], r["d"]
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    try:
        with sdpa_kernel(backend):
            return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
    except RuntimeError as e:
        print(f"# SDPA {backend}: {str(e).splitlines()[0]}")
        return None


def fmt(x, digits=4):
    return "" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return "" if a is None or b is None else f"{a / b:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flexc", required=True, help="the bench_linear command (with --json)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    out = subprocess.run(shlex.split(args.flexc), check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| case | flexc ms | flexc GB/s | fla ms | x fla | FA2 causal ms | x FA2 | cuDNN causal ms |"
          " x cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fla = fla_forward(r, args.reps)
        fa2 = cudnn = None
        if not r["step"]:
            fa2 = sdpa_causal(r, SDPBackend.FLASH_ATTENTION, args.reps)
            cudnn = sdpa_causal(r, SDPBackend.CUDNN_ATTENTION, args.reps)
        print(f"| {r['case']} | {fmt(r['ms'])} | {r['gbs']:.0f} | {fmt(fla)} | {ratio(fla, r['ms'])} |"
              f" {fmt(fa2)} | {ratio(fa2, r['ms'])} | {fmt(cudnn)} | {ratio(cudnn, r['ms'])} |",
              flush=True)
    print(f"# device copy: {bench_peers.copy_gbs(args.reps, inner=5):.0f} GB/s (read + write)")


if __name__ == "__main__":
    main()
