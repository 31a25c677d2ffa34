#!/usr/bin/env python3
"""Gated linear attention: flexc against flash-linear-attention and softmax attention, same run.

Runs flexc's tools/bench_linear --json, then on each of its forward shapes (B, T, H, D, bf16):
flash-linear-attention's Triton kernels on the same gates (chunk_gla for gates per key dim,
chunk_simple_gla for one gate per step or none; layout [B, T, H, D], float32 gates), and
softmax attention with a causal mask through SDPA's FlashAttention-2 and cuDNN backends. For the
step: fla's fused_recurrent_gla on one token, and a device copy of 2 GiB (read + write bandwidth,
what a kernel that reads and writes the state once can reach).

    python3 tools/bench_linear_peers.py --flexc "build/bench_linear --json"
    python3 tools/bench_linear_peers.py --backward --flexc "build/bench_linear --json"

With --backward (passed on to bench_linear), a second table: forward + backward back to back for
the chunkwise cases, flexc's against fla's (torch.autograd.grad of dq, dk, dv and, with gates, dg;
no initial or final state, as flexc) and SDPA's causal FlashAttention-2 and cuDNN (dq, dk, dv).

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


def fwdbwd_ms(fwd, inputs, reps):
    """fwd() and the gradients of its output for `inputs`, by torch.autograd.grad rather than
    backward(): nothing is added into .grad, as flexc writes its gradients."""
    dout = torch.randn_like(fwd())
    return time_ms(lambda: torch.autograd.grad(fwd(), inputs, dout), reps)


def fla_time(r, reps, backward=False):
    """fla on the case's shape and gate kind, forward or (chunkwise cases) forward + backward, or
    None when fla is not installed."""
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        print(f"# fla not available: {e}")
        return None
    b, t, h, d = r["b"], r["t"], r["h"], r["d"]
    dev = "cuda"
    q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    if r["step"]:
        g = F.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16
        state = torch.zeros(b, h, d, d, device=dev, dtype=torch.float32)
        return time_ms(lambda: fused_recurrent_gla(q, k, v, gk=g, initial_state=state,
                                                   output_final_state=True), reps)
    if r["gates"] == "dim":
        g = (F.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16).requires_grad_(backward)

        def fwd():
            return chunk_gla(q, k, v, g)[0]
    else:
        g = None
        if r["gates"] == "step":
            g = (F.logsigmoid(torch.randn(b, t, h, device=dev)) / 16).requires_grad_(backward)

        def fwd():
            return chunk_simple_gla(q, k, v, g=g)[0]
    try:
        if not backward:
            return time_ms(fwd, reps)
        return fwdbwd_ms(fwd, [x for x in (q, k, v, g) if x is not None], reps)
    except RuntimeError as e:
        # fla 0.6 refuses chunk_simple_gla's gated backward on Hopper with Triton 3.4 to 3.7.0.
        print(f"# fla {r['case']}: {str(e).splitlines()[0]}")
        return None


def sdpa_causal(r, backend, reps, backward=False):
    """SDPA causal forward, or forward + backward, on the case's shape; None where the backend
    cannot run it."""
    b, t, h, d = r["b"], r["t"], r["h"], r["d"]
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        with sdpa_kernel(backend):
            return fwdbwd_ms(fwd, (q, k, v), reps) if backward else time_ms(fwd, reps)
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
    ap.add_argument("--backward", action="store_true",
                    help="also forward + backward (adds --backward to the flexc command)")
    args = ap.parse_args()
    cmd = shlex.split(args.flexc)
    if args.backward and "--backward" not in cmd:
        cmd.append("--backward")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # A feature map's case measures its own cost (bench_linear prints it); fla's kernels have none.
    rows = [r for r in rows if not r.get("feature_map")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| case | flexc ms | flexc GB/s | fla ms | x fla | FA2 causal ms | x FA2 | cuDNN causal ms |"
          " x cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fla = fla_time(r, args.reps)
        fa2 = cudnn = None
        if not r["step"]:
            fa2 = sdpa_causal(r, SDPBackend.FLASH_ATTENTION, args.reps)
            cudnn = sdpa_causal(r, SDPBackend.CUDNN_ATTENTION, args.reps)
        print(f"| {r['case']} | {fmt(r['ms'])} | {r['gbs']:.0f} | {fmt(fla)} | {ratio(fla, r['ms'])} |"
              f" {fmt(fa2)} | {ratio(fa2, r['ms'])} | {fmt(cudnn)} | {ratio(cudnn, r['ms'])} |",
              flush=True)
    if args.backward:
        print("\n| case | flexc fwd+bwd ms | flexc bwd ms | fla fwd+bwd ms | x fla |"
              " FA2 causal fwd+bwd ms | x FA2 | cuDNN causal fwd+bwd ms | x cuDNN |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["step"]:  # no backward
                continue
            fb = r["fwdbwd_ms"]
            fla = fla_time(r, args.reps, backward=True)
            fa2 = sdpa_causal(r, SDPBackend.FLASH_ATTENTION, args.reps, backward=True)
            cudnn = sdpa_causal(r, SDPBackend.CUDNN_ATTENTION, args.reps, backward=True)
            print(f"| {r['case']} | {fmt(fb)} | {fmt(r['bwd_ms'])} | {fmt(fla)} |"
                  f" {ratio(fla, fb)} | {fmt(fa2)} | {ratio(fa2, fb)} | {fmt(cudnn)} |"
                  f" {ratio(cudnn, fb)} |", flush=True)
    print(f"# device copy: {bench_peers.copy_gbs(args.reps, inner=5):.0f} GB/s (read + write)")


if __name__ == "__main__":
    main()
