#!/usr/bin/env python3
"""BlockMask construction: torch.compile(create_block_mask) on the shapes of tools/bench_blockmask.

Causal, sliding window 1024 (+ causal), prefix LM 2048 (or causal) and a six-document mask, B = H = 1,
128 x 128 tiles, S = q_len = kv_len from 1k to 1M. With --flexc it first runs flexc's benchmark (its
--json output) in the same process tree on the same GPU and prints the ratio torch / flexc (> 1:
flexc faster).

    python3 tools/bench_blockmask_peers.py --flexc "build/bench_blockmask --json"

Timing: CUDA events around single calls after warm-up calls (the first compiles), median of --reps.
Sizes that run out of memory are skipped with a message; after a call slower than --max-seconds the
larger sizes of that mask are skipped (PyTorch evaluates the mask on every element).
"""
import argparse
import json
import shlex
import subprocess
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

# tools/bench_peers.py: the masks (the same definitions as the attention benchmark, incl. the
# six-document split) and the timing (CUDA events, warm-up, median).
from bench_peers import make_case, time_ms


def time_ms_within(fn, reps, max_seconds):
    """Median ms of fn() (bench_peers.time_ms), or None when a first call exceeds max_seconds."""
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    if time.perf_counter() - t0 > max_seconds:
        return None
    return time_ms(fn, reps)


def run_flexc(cmd):
    out = subprocess.run(shlex.split(cmd), check=True, capture_output=True, text=True).stdout
    return {(r["mask"], r["s"]): r for r in map(json.loads, filter(None, out.splitlines()))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096,16384,131072,1048576")
    ap.add_argument("--masks", default="causal,sliding_window,prefix_lm,document")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=30.0)
    ap.add_argument("--flexc", help="command running flexc's bench_blockmask with --json")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    masks = a.masks.split(",")
    flexc = run_flexc(a.flexc) if a.flexc else {}
    device = "cuda"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", file=sys.stderr)
    # Every (mask, size) is a new compile of create_block_mask; past dynamo's default limit it
    # would silently fall back to eager.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    cbm = torch.compile(create_block_mask)
    print("| mask | tokens | torch.compile(create_block_mask) ms | flexc ms | torch / flexc |")
    print("|---|---|---|---|---|")
    for name in masks:
        skip = None
        for s in sizes:
            f = flexc.get((name, s))
            fx = f"{f['ms']:.4f}" if f else "-"
            if skip:
                print(f"| {name} | {s} | skipped ({skip}) | {fx} | - |", flush=True)
                continue
            try:
                mm = make_case(name, s, 1, device)[1]
                ms = time_ms_within(lambda: cbm(mm, 1, 1, s, s, device=device), a.reps,
                                    a.max_seconds)
                if ms is None:
                    skip = f"a call at {s} tokens took over {a.max_seconds:g} s"
                    print(f"| {name} | {s} | over {a.max_seconds:g} s | {fx} | - |", flush=True)
                    continue
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not isinstance(e, torch.cuda.OutOfMemoryError) and "out of memory" not in str(e):
                    raise
                skip = f"out of memory at {s} tokens"
                torch.cuda.empty_cache()
                print(f"| {name} | {s} | out of memory | {fx} | - |", flush=True)
                continue
            ratio = f"{ms / f['ms']:.1f}" if f else "-"
            print(f"| {name} | {s} | {ms:.4f} | {fx} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
