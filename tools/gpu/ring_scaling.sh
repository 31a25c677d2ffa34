#!/usr/bin/env bash
# Issue 16's run, on a GPU machine with N GPUs after tools/gpu/pack.sh: ring attention's [ring]
# tests (the 2- and 4-GPU cases; those needing more GPUs than the machine has skip), a
# `--check` of the ring over all N GPUs against the float64 reference, then the benchmark at
# B 1, H 16, D 128, 8k and 32k tokens a GPU, no mask and causal (zigzag), forward and forward +
# backward: tools/bench_ring.cpp against single-GPU flexc, tools/bench_ring_peers.py (PyTorch's
# context parallel over SDPA) in the same run.
#   bash tools/gpu/ring_scaling.sh N      (results in $OUT, default ./out: six files)
# REPS (default 5) sets the timed repetitions; STEP_TIMEOUT (seconds, default 240) bounds each
# step, so that a hang leaves the other steps' results.
set -uo pipefail
cd "$(dirname "$0")/../.."
n=${1:?usage: ring_scaling.sh N}
OUT=${OUT:-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
export FLEXC_CACHE_DIR=${FLEXC_CACHE_DIR:-/tmp/flexc-cache} NCCL_NVLS_ENABLE=0
if [ -z "${FLEXC_NCCL:-}" ] && ! ldconfig -p | grep -q libnccl.so.2; then
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -n "$nccl" ] && [ -f "$nccl" ] && export FLEXC_NCCL=$nccl
fi
limit=${STEP_TIMEOUT:-240}
reps=${REPS:-5}
lens=$((8192 * n)),$((32768 * n))
status=0
step() {  # step NAME COMMAND...: its output to $OUT/NAME.txt, its status noted
  local name=$1; shift
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc $rc" | tee -a "$OUT/steps.txt"
  [ $rc = 0 ] || status=1
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader >"$OUT/steps.txt"
step tests .carry/bin/test_ring "[ring]"
step check .carry/bin/flexc run @causal --random 1,4,2,$((512 * n)),$((512 * n)),128 \
  --ranks "$n" --backward --check
step bench_ring bash -c ".carry/bin/bench_ring --ranks $n --seq-lens $lens --cases noop,causal \
  --reps $reps && .carry/bin/bench_ring --ranks $n --seq-lens $lens --cases noop,causal \
  --reps $reps --backward"
step bench_peers bash -c "torchrun --nproc_per_node $n tools/bench_ring_peers.py --seq-lens $lens \
  --reps $reps && torchrun --nproc_per_node $n tools/bench_ring_peers.py --seq-lens $lens \
  --reps $reps --backward"
tail -3 "$OUT/tests.txt"; grep -E "PASS|FAIL" "$OUT/check.txt"
grep "^|" "$OUT/bench_ring.txt"; grep "^|" "$OUT/bench_peers.txt"
exit $status
