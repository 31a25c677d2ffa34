"""PyTorch's context parallel (ring attention over SDPA) on the shapes of tools/bench_ring.cpp, for
issue 14's comparison in the same run: B 1, H 16, D 128, no mask and causal, --seq-lens tokens in
total, sharded over the torchrun job's GPUs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 tools/bench_ring_peers.py \
        [--seq-lens 65536,262144] [--cases noop,causal] [--reps 5] [--backward]

Each row: one SDPA backend (flash, cudnn) and one rotate method (allgather: K/V gathered up front;
alltoall: passed around the ring), its time per call (per repetition the slowest rank's CUDA-event
time from a common start, median of --reps after 2 warm-ups), and TFLOP/s of the whole sequence
(forward 4 * B * H * S * S * D * density, as tools/bench_ring.cpp; with --backward, forward +
backward: 3.5 times that, the backward counting 2.5 times the forward as the peers do). Causal
uses PyTorch's load balancing (its default), the counterpart of flexc's zigzag shards.
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from torch.distributed.tensor.experimental import _attention as cp_attention
except ImportError:  # moved in later releases
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

H, D, WARMUPS = 16, 128, 2
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def time_cp(mesh, s, causal, backend, rotate, reps, backward):
    cp_attention.set_rotate_method(rotate)
    # Load balancing (zigzag-like shards) is for causal masks only; PyTorch refuses it otherwise.
    cp_attention._cp_options.enable_load_balance = causal
    g = torch.Generator(device="cuda").manual_seed(1234)  # the same whole tensors on every rank
    q, k, v = (
        torch.empty(1, H, s, D, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2, generator=g)
        for _ in range(3)
    )
    dout = torch.empty(1, H, s, D, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1, generator=g)
    times = []
    with context_parallel(
        mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, dout}
    ):
        for t in (q, k, v):
            t.requires_grad_(backward)
        with sdpa_kernel(BACKENDS[backend]):
            for r in range(reps + WARMUPS):
                torch.cuda.synchronize()
                dist.barrier()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                if backward:
                    out.backward(dout)
                stop.record()
                stop.synchronize()
                ms = torch.tensor([start.elapsed_time(stop)], device="cuda")
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                if r >= WARMUPS:
                    times.append(ms.item())
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", default="65536,262144")
    ap.add_argument("--cases", default="noop,causal")
    ap.add_argument("--backends", default="flash,cudnn")
    ap.add_argument("--rotate", default="allgather,alltoall")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh("cuda", (world,))
    if rank == 0:
        print("| case | S | ranks | backend | rotate | pass | ms | TFLOP/s |")
        print("|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        causal = case == "causal"
        for s in (int(x) for x in args.seq_lens.split(",")):
            flops = 4 * H * s * s * D * ((s + 1) / (2 * s) if causal else 1.0) * (3.5 if args.backward else 1.0)
            for backend in args.backends.split(","):
                for rotate in args.rotate.split(","):
                    try:
                        ms = time_cp(mesh, s, causal, backend, rotate, args.reps, args.backward)
                        row = f"{ms:.2f} | {flops / ms * 1e-9:.1f}"
                    except Exception as e:  # a backend or method this build cannot run
                        row = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]}) | "
                    if rank == 0:
                        kind = "fwd+bwd" if args.backward else "fwd"
                        print(f"| {case} | {s} | {world} | {backend} | {rotate} | {kind} | {row} |",
                              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
