#!/usr/bin/env python3
"""Decode: flexc::decode against PyTorch's peers on the same shapes, in the same GPU run.

Runs flexc's tools/bench_decode --json, then on each of its shapes (one query, or a few, per
sequence against a KV cache; Hq 32, Hkv 8, D 128): SDPA with the flash backend (FlashAttention-2)
and the cuDNN backend (no mod only: SDPA has no decode positions for a mask), and
torch.compile(flex_attention) (its decode kernel for short queries; the masks with the queries at
the end of the sequence, as flexc's default positions); with --flex-paged, flexc's paged rows
against FlexAttention's PagedAttention (experimental) on pages of the same size. Also a device-to-device copy of 2 GiB,
whose bandwidth (read + write bytes / time) bounds what a read-only kernel can reach.

    python3 tools/bench_decode_peers.py --flexc "build/bench_decode --json"

GB/s = the bytes flexc's benchmark counts (K and V read once where the mask keeps them) / time,
for every column, so ratios are time ratios. Timing as bench_decode's: CUDA events around 10
back-to-back calls, warm-up, median of --reps. Peers see contiguous K / V; flexc's paged rows compare with the same shape's
contiguous peers.
"""
import argparse
import json
import shlex
import subprocess
import sys

import bench_peers  # tools/, beside this script
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def time_ms(fn, reps):
    """As bench_decode times: 10 back-to-back calls per run, 5 warm-ups."""
    return bench_peers.time_ms(fn, reps, inner=10, warmup=5)


def mods(r, device):
    """The case's score_mod and mask_mod for Flex, with the queries at the sequence's end."""
    v, kv, q_len = r["variant"], r["kv"], r["q_len"]
    off = kv - q_len  # position of query 0
    score_mod = mask_mod = None
    if v == "alibi":
        slopes = torch.exp2(-8.0 * torch.arange(1, r["hq"] + 1, device=device) / r["hq"])

        def score_mod(s, b, h, q, k):
            return s + slopes[h] * (k - (q + off))
    elif v == "softcap":
        def score_mod(s, b, h, q, k):
            return 30.0 * torch.tanh(s / 30.0)
    elif v == "causal":
        def mask_mod(b, h, q, k):
            return q + off >= k
    elif v == "sliding_window":
        w = r["window"]

        def mask_mod(b, h, q, k):
            return (q + off >= k) & (q + off - k < w)
    return score_mod, mask_mod


def flex_paged(flex, q, k, v, r, score_mod, mask_mod, reps):
    """FlexAttention's paged attention (torch.nn.attention.experimental, pages of r["page"] keys)
    on a cache holding k and v: milliseconds, or an exception where it does not run."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    b, hkv, kv, d = k.shape
    page = r["page"]
    pa = PagedAttention(b * kv // page, page, b, device="cuda")
    k_cache = torch.zeros(1, hkv, b * kv, d, device="cuda", dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    for i in range(b):
        pa.reserve(torch.tensor(i, device="cuda"), torch.tensor(kv, device="cuda"))
    batch = torch.arange(b, device="cuda")
    pos = torch.arange(kv, device="cuda").expand(b, kv)
    pa.assign(batch, pos, k, v, k_cache, v_cache)
    logical = create_block_mask(mask_mod or (lambda b_, h, q_, k_: q_ >= 0), b, None, r["q_len"], kv,
                                device="cuda", BLOCK_SIZE=(r["q_len"], page))
    bm = pa.convert_logical_block_mask(logical)
    sm = pa.get_score_mod(score_mod)
    return time_ms(lambda: flex(q, k_cache, v_cache, score_mod=sm, block_mask=bm, enable_gqa=True),
                   reps)


def run_flexc(cmd):
    out = subprocess.run(shlex.split(cmd), check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flexc", required=True, help="bench_decode command with --json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--flex-paged", action="store_true",
                    help="compare flexc's paged rows with FlexAttention's PagedAttention "
                         "(experimental) instead of contiguous Flex")
    args = ap.parse_args()
    device = "cuda"
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    flex = torch.compile(flex_attention, dynamic=False)
    rows = run_flexc(args.flexc)
    copy = bench_peers.copy_gbs(args.reps, inner=10, warmup=5)
    print(f"# device-to-device copy: {copy:.0f} GB/s (read + write)")
    peers = {}  # (variant, b, kv, q_len) -> {label: GB/s}
    paged = {}  # (variant, b, kv, q_len, page) -> GB/s of Flex's paged attention
    print(f"{'case':30s} {'flexc':>7s} {'flash':>7s} {'cudnn':>7s} {'flex':>7s} "
          f"{'x best SDPA':>11s} {'x flex':>7s} {'% copy':>7s}")
    for r in rows:
        key = (r["variant"], r["b"], r["kv"], r["q_len"])
        if key not in peers:
            b, hq, hkv, kv, q_len, d = r["b"], r["hq"], r["hkv"], r["kv"], r["q_len"], r["d"]
            q = torch.randn(b, hq, q_len, d, device=device, dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, kv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
            got = {}
            if r["variant"] == "noop":
                for backend, label in ((SDPBackend.FLASH_ATTENTION, "flash"),
                                       (SDPBackend.CUDNN_ATTENTION, "cudnn")):
                    try:
                        with sdpa_kernel(backend):
                            fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                            got[label] = time_ms(fn, args.reps)
                    except RuntimeError as e:
                        print(f"# {label} {r['case']}: {str(e).splitlines()[0]}", file=sys.stderr)
            score_mod, mask_mod = mods(r, device)
            bm = (create_block_mask(mask_mod, None, None, q_len, kv, device=device)
                  if mask_mod else None)
            try:
                got["flex"] = time_ms(lambda: flex(q, k, v, score_mod=score_mod, block_mask=bm,
                                                   enable_gqa=True), args.reps)
            except Exception as e:
                print(f"# flex {r['case']}: {str(e).splitlines()[-1]}", file=sys.stderr)
            peers[key] = {label: r["bytes"] / (ms * 1e-3) / 1e9 for label, ms in got.items()}
            del q, k, v
        p = dict(peers[key])
        if r["page"] and args.flex_paged:  # Flex's own paged attention replaces its contiguous run
            pkey = key + (r["page"],)
            if pkey not in paged:
                b, hq, hkv, kv, q_len, d = r["b"], r["hq"], r["hkv"], r["kv"], r["q_len"], r["d"]
                q = torch.randn(b, hq, q_len, d, device=device, dtype=torch.bfloat16)
                k, v = (torch.randn(b, hkv, kv, d, device=device, dtype=torch.bfloat16)
                        for _ in range(2))
                score_mod, mask_mod = mods(r, device)
                try:
                    paged[pkey] = r["bytes"] / (flex_paged(flex, q, k, v, r, score_mod, mask_mod,
                                                           args.reps) * 1e-3) / 1e9
                except Exception as e:
                    paged[pkey] = None
                    print(f"# flex paged {r['case']}: {str(e).splitlines()[-1] if str(e) else repr(e)}",
                          file=sys.stderr)
                del q, k, v
            p["flex"] = paged[pkey]
        sdpa = max([p[x] for x in ("flash", "cudnn") if x in p], default=None)
        fmt = lambda x: f"{x:7.0f}" if x else f"{'-':>7s}"
        ratio = lambda x: f"{r['gbs'] / x:.2f}" if x else "-"
        print(f"{r['case']:30s} {r['gbs']:7.0f} {fmt(p.get('flash'))} {fmt(p.get('cudnn'))} "
              f"{fmt(p.get('flex'))} {ratio(sdpa):>11s} {ratio(p.get('flex')):>7s} "
              f"{100 * r['gbs'] / copy:6.0f}%")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
