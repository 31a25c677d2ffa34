#!/usr/bin/env python3
"""Attention: PyTorch's peers on the shapes of tools/bench_attention, in the same GPU run.

Runs SDPA with the flash backend (FlashAttention-2) and the cuDNN backend, and
torch.compile(flex_attention), on the anchors' shapes (../shared/anchors.md): 16k tokens per batch,
H*D = 2048, S = 1k/4k/16k, D = 64/128 for no mask and causal; six variants at S = 16k, B = 1,
H = 16, D = 128. With --flexc it first runs flexc's benchmark (its --json output) and prints
flexc / peer ratios per case (> 1: flexc faster).

    python3 tools/bench_peers.py --flexc "build/bench_attention --json"
    python3 tools/bench_peers.py --backward --flexc "build/bench_attention --backward --json"
    python3 tools/bench_peers.py --gallery tools/gallery.json \
        --flexc "build/bench_attention --gallery tools/gallery.json --json"

With --head-dims, noop and causal at S = 4k / 16k and softcap at 16k for D = 96, 192, 256, and
noop_dv128 / causal_dv128 with q / k head dim 192 and v's 128 (H = 16; bench_attention
--head-dims runs the same). FLOPs then count 2*B*H*S*S*(D + Dv)*density.

With --packed, noop and causal as B packed sequences of S tokens (flexc: bench_attention --packed,
rows KERNEL_packed beside the dense ones): FA2 is then PyTorch's varlen_attn over the same packed
tensors, Flex a document mask over the pack as one sequence of 16k tokens (FlexAttention's way to
run packed sequences), cuDNN the dense call on the same tokens.

With --backward, the backward pass alone is timed (torch.autograd.grad of a saved forward, with
the flexc numbers from bench_attention --backward), FLOPs 2.5 times the forward's.

FLOPs: 4*B*H*S*S*D*density, density = the exact fraction of (q, kv) pairs the mask keeps (the same
definition as bench_attention), so TFLOP/s compare directly. Timing: CUDA events around single
calls, warm-up, median of --reps.
"""
import argparse
import json
import math
import shlex
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

TOKENS, HIDDEN = 16384, 2048
WINDOW, PREFIX, DOCS, CAP = 1024, 2048, 6, 30.0


def doc_ids(s, device):
    # Six documents of (nearly) equal length: document 6 i / S (bench_attention's "docs" fill).
    return (torch.arange(s, device=device) * DOCS // s).to(torch.int32)


DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int32": torch.int32, "bool": torch.bool}


def fill(kind, shape, dtype, device):
    """A capture's contents as bench_attention fills it (its fill_capture)."""
    count, n = math.prod(shape), shape[-1]
    i = torch.arange(count, device=device, dtype=torch.int64)
    if kind == "slopes":
        x = torch.exp2(-8.0 * (i % n + 1).double() / n)
    elif kind == "ramp":
        x = 0.01 * (i % 97).double() - 0.5
    elif kind == "docs":
        x = (i % n * DOCS // n).double()
    else:
        raise ValueError(f"unknown fill {kind}")
    return x.view(shape).to(DTYPES[dtype])


def gallery_case(entry, b, h, s, device):
    """(score_mod, mask_mod, ()) of a gallery entry: its torch expressions over its captures."""
    dims = {"B": b, "H": h, "Q_LEN": s, "KV_LEN": s}
    ns = {"torch": torch}
    for c in entry.get("captures", []):
        shape = [dims[x] if isinstance(x, str) else int(x) for x in c["shape"]]
        ns[c["name"]] = fill(entry["fills"][c["name"]], shape, c["dtype"], device)
    t = entry["torch"]
    score = eval(f"lambda sc, b, h, q, kv: {t['score_mod']}", ns) if "score_mod" in t else None
    mask = eval(f"lambda b, h, q, kv: {t['mask_mod']}", ns) if "mask_mod" in t else None
    return score, mask, ()


def make_case(name, s, h, device):
    """(score_mod, mask_mod, learnable) for flex_attention; None where the case has none;
    learnable: the captured tensors whose gradient the backward computes."""
    name = name.removesuffix("_dv128")  # v's head dim apart: the same mods
    if name == "noop":
        return None, None, ()
    if name == "causal":
        return None, lambda b, hh, q, kv: q >= kv, ()
    if name.startswith("alibi"):
        slope = torch.exp2(-8.0 * torch.arange(1, h + 1, device=device) / h)
        slope.requires_grad_(name == "alibi_dslope")
        return (lambda sc, b, hh, q, kv: sc + slope[hh] * (kv - q)), None, \
            (slope,) if slope.requires_grad else ()
    if name.startswith("rel_bias"):
        # bench_attention's table: bias[h, clamp(kv - q, -128, 127) + 128]
        bias = (0.01 * (torch.arange(h * 256, device=device) % 97) - 0.5).view(h, 256).float()
        bias.requires_grad_(name == "rel_bias_dbias")
        return (lambda sc, b, hh, q, kv: sc + bias[hh, torch.clamp(kv - q, -128, 127) + 128]), \
            None, (bias,) if bias.requires_grad else ()
    if name == "softcap":
        return (lambda sc, b, hh, q, kv: CAP * torch.tanh(sc / CAP)), None, ()
    if name == "t5_bias":
        # the catalogue's buckets over bench_attention's "ramp" table bias[h, 32]
        bias = fill("ramp", (h, 32), "float32", device)

        def t5(sc, b, hh, q, kv):
            rel = kv - q
            n = torch.abs(rel)
            far = torch.clamp(8 + (2 * torch.log2(n / 8)).to(torch.int32), max=15)
            return sc + bias[hh, torch.where(rel > 0, 16, 0) + torch.where(n < 8, n, far)]
        return t5, None, ()
    if name == "sliding_window":
        return None, lambda b, hh, q, kv: (q >= kv) & (q - kv < WINDOW), ()
    if name == "prefix_lm":
        return None, lambda b, hh, q, kv: (kv < PREFIX) | (q >= kv), ()
    if name == "document":
        doc = doc_ids(s, device)
        return None, lambda b, hh, q, kv: doc[q] == doc[kv], ()
    raise ValueError(name)


def density(mask_mod, s, device):
    if mask_mod is None:
        return 1.0
    kept = 0
    q = torch.arange(s, device=device)
    for r0 in range(0, s, 2048):  # row blocks keep the boolean grid small
        qq = q[r0:r0 + 2048, None]
        kept += int(mask_mod(0, 0, qq, q[None, :]).sum())
    return kept / (s * s)


def time_ms(fn, reps, inner=1, warmup=3):
    """Median over `reps` runs of the mean time of `inner` back-to-back calls of fn."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    return times[len(times) // 2]


def copy_gbs(reps, **timing):
    """Read + write bandwidth of a 2 GiB device-to-device copy (GB/s): what a kernel that reads
    its data once and writes it once can reach. `timing`: time_ms's inner / warmup."""
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), reps, **timing)
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e9


def cases(backward, gallery, head_dims=False, seqs=None):
    if head_dims:
        for d in (96, 192, 256):
            for s in (4096, 16384):
                for name in ("noop", "causal"):
                    yield name, s, d
            yield "softcap", 16384, d
        for s in (4096, 16384):
            for name in ("noop_dv128", "causal_dv128"):
                yield name, s, 192
        return
    if gallery:
        for entry in gallery:
            for d in (64, 128):
                for s in seqs or (8192, 16384):
                    yield entry["name"], s, d
        return
    for d in (64, 128):
        for s in seqs or (1024, 4096, 16384):
            for name in ("noop", "causal"):
                yield name, s, d
    for name in ("alibi", "softcap", "sliding_window", "prefix_lm", "document", "t5_bias"):
        yield name, 16384, 128
    if backward:  # learnable biases, with and without their gradient
        for name in ("alibi_dslope", "rel_bias", "rel_bias_dbias"):
            yield name, 16384, 128


def timed(fn, backward, inputs, reps):
    """Milliseconds of fn(), or with `backward` of the gradient of a saved fn() output."""
    if not backward:
        return time_ms(fn, reps)
    out = fn()
    dout = torch.randn_like(out)
    return time_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), reps)


def packed_peers(row, name, b, h, s, d, reps, flex, device):
    """--packed: FA2's varlen over the pack, and Flex's document mask over it as one sequence."""
    causal = name == "causal"
    t = b * s
    qp, kp, vp = (torch.randn(t, h, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, t + 1, s, device=device, dtype=torch.int32)
    try:
        from torch.nn.attention.varlen import varlen_attn
        window = (-1, 0) if causal else (-1, -1)
        row["sdpa_flash"] = time_ms(lambda: varlen_attn(qp, kp, vp, cu, cu, s, s,
                                                        window_size=window), reps)
    except (ImportError, RuntimeError) as e:
        print(f"# varlen_attn {name} S={s} D={d}: {str(e).splitlines()[0]}", file=sys.stderr)
    doc = torch.arange(t, device=device) // s
    if causal:
        mask_mod = lambda bb, hh, q, kv: (doc[q] == doc[kv]) & (q >= kv)
    else:
        mask_mod = lambda bb, hh, q, kv: doc[q] == doc[kv]
    bm = create_block_mask(mask_mod, None, None, t, t, device=device)
    q1, k1, v1 = (x.view(1, t, h, d).transpose(1, 2).contiguous() for x in (qp, kp, vp))
    row["flex"] = time_ms(lambda: flex(q1, k1, v1, block_mask=bm), reps)


def run_peers(reps, only, backward, gallery, head_dims, seqs, packed=False):
    device = "cuda"
    # One compiled kernel per shape and variant: let dynamo keep them all.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    flex = torch.compile(flex_attention, dynamic=False)
    results = {}
    entries = {e["name"]: e for e in gallery or []}
    for name, s, d in cases(backward, gallery, head_dims, seqs):
        if only and name not in only:
            continue
        b, h = TOKENS // s, 16 if head_dims else HIDDEN // d
        dv = 128 if name.endswith("_dv128") else d
        q, k, v = (torch.randn(b, h, s, e, device=device, dtype=torch.bfloat16,
                               requires_grad=backward) for e in (d, d, dv))
        score_mod, mask_mod, learnable = (gallery_case(entries[name], b, h, s, device)
                                          if gallery else make_case(name, s, h, device))
        dens = density(mask_mod, s, device)
        flops = (2.5 if backward else 1.0) * 2.0 * b * h * s * s * (d + dv) * dens
        row = {"density": dens}
        if packed:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row["sdpa_cudnn"] = time_ms(lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=name == "causal"), reps)
            packed_peers(row, name, b, h, s, d, reps, flex, device)
            row["tflops"] = {k2: flops / t * 1e-9 for k2, t in row.items() if k2 != "density"}
            results[(name, s, d)] = row
            print(f"# {name:15s} S={s:5d} D={d:3d} packed: " +
                  " ".join(f"{k2} {t:.1f}" for k2, t in row["tflops"].items()), file=sys.stderr)
            del q, k, v
            continue
        if name.removesuffix("_dv128") in ("noop", "causal") and not gallery:
            for backend, label in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"),
                                   (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
                try:
                    with sdpa_kernel(backend):
                        fn = lambda: F.scaled_dot_product_attention(
                            q, k, v, is_causal=name.startswith("causal"))
                        row[label] = timed(fn, backward, (q, k, v), reps)
                except RuntimeError as e:  # a backend that does not support the shape
                    print(f"# {label} {name} S={s} D={d}: {str(e).splitlines()[0]}", file=sys.stderr)
        bm = create_block_mask(mask_mod, None, None, s, s, device=device) if mask_mod else None
        try:
            row["flex"] = timed(lambda: flex(q, k, v, score_mod=score_mod, block_mask=bm), backward,
                                (q, k, v) + tuple(learnable), reps)
        except Exception as e:  # e.g. Inductor finding no kernel config that fits shared memory
            print(f"# flex {name} S={s} D={d}: {str(e).splitlines()[-1]}", file=sys.stderr)
        row["tflops"] = {k2: flops / t * 1e-9 for k2, t in row.items() if k2 not in ("density",)}
        results[(name, s, d)] = row
        print(f"# {name:15s} S={s:5d} D={d:3d} density {dens:.4f} " +
              " ".join(f"{k2} {t:.1f}" for k2, t in row["tflops"].items()), file=sys.stderr)
        del q, k, v
    return results


def run_flexc(cmd):
    """{kernel: {(case, s, d): result}} from the benchmark's JSON lines."""
    out = subprocess.run(shlex.split(cmd), check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            res.setdefault(r.get("kernel", "auto"), {})[(r["case"], r["s"], r["d"])] = r
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flexc", help="command that runs flexc's benchmark with --json output")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", nargs="*", help="case names to run (default: all)")
    ap.add_argument("--backward", action="store_true", help="time the backward pass")
    ap.add_argument("--gallery", help="run this gallery's variants (tools/gallery.json) instead")
    ap.add_argument("--head-dims", action="store_true",
                    help="run noop, causal and softcap at D = 96, 192, 256 (H = 16) instead")
    ap.add_argument("--packed", action="store_true",
                    help="noop and causal as packed sequences (FA2: varlen_attn; Flex: a "
                         "document mask over the pack); flexc's --flexc command with --packed")
    ap.add_argument("--seqs", type=lambda t: tuple(int(x) for x in t.split(",")),
                    help="sequence lengths of noop and causal (default 1k, 4k, 16k) or of the "
                         "gallery's (default 8k, 16k), comma-separated (bench_attention --seqs)")
    args = ap.parse_args()
    gallery = json.load(open(args.gallery))["variants"] if args.gallery else None
    ours = run_flexc(args.flexc) if args.flexc else {}
    if args.packed and (args.backward or gallery or args.head_dims):
        ap.error("--packed times the forward of noop and causal")
    peers = run_peers(args.reps, args.only or (["noop", "causal"] if args.packed else None),
                      args.backward, gallery, args.head_dims, args.seqs, args.packed)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    hdr = f"{'case':15s} {'kernel':8s} {'S':>5s} {'D':>3s} {'dens':>6s} {'flexc':>6s} {'FA2':>6s} " \
          f"{'cuDNN':>6s} {'Flex':>6s} {'x FA2':>6s} {'x cuDNN':>7s} {'x Flex':>6s}"
    print("TFLOP/s; x PEER = flexc / peer (time ratio)")
    if args.packed:
        print("packed: FA2 = varlen_attn over the pack, cuDNN = the dense call on the same tokens, "
              "Flex = a document mask over the pack as one sequence")
    print(hdr)
    for key, row in peers.items():
        name, s, d = key
        tf = row["tflops"]
        for kernel in ours or {"-": {}}:
            mine = ours.get(kernel, {}).get(key)
            fmt = lambda x: f"{x:6.1f}" if x is not None and not math.isnan(x) else f"{'-':>6s}"
            ratio = lambda peer: f"{row[peer] / mine['ms']:.2f}" if mine and peer in row else "-"
            print(f"{name:15s} {kernel:8s} {s:5d} {d:3d} {row['density']:6.3f} "
                  f"{fmt(mine['tflops'] if mine else None)} {fmt(tf.get('sdpa_flash'))} "
                  f"{fmt(tf.get('sdpa_cudnn'))} {fmt(tf.get('flex'))} {ratio('sdpa_flash'):>6s} "
                  f"{ratio('sdpa_cudnn'):>7s} {ratio('flex'):>6s}")
    # Per kernel: the geometric mean of flexc's speed-up over Flex, and the cases below 1.
    for kernel, mine in ours.items():
        r = {k: peers[k]["flex"] / v["ms"] for k, v in mine.items() if "flex" in peers.get(k, {})}
        if r:
            gm = math.exp(sum(math.log(x) for x in r.values()) / len(r))
            slow = ", ".join(f"{n} S={s} D={d} {x:.2f}" for (n, s, d), x in r.items() if x < 1)
            print(f"{kernel}: x Flex geometric mean {gm:.2f} over {len(r)} cases; "
                  f"min {min(r.values()):.2f}; below 1: {slow or 'none'}")


if __name__ == "__main__":
    main()
