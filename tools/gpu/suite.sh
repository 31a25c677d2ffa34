#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, after tools/gpu/pack.sh staged .carry/ here: the
# [gpu] tests of every test binary, each binary in its own process at once (cold, most of the
# time is NVRTC compiling kernels on the CPU; they share the JIT cache, which is safe across
# processes). Logs go to $OUT (default ./out). Optional $1: a Catch2 test spec instead of [gpu].
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
export FLEXC_CACHE_DIR=/tmp/flexc-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
spec=${1:-[gpu]}
declare -A pids
for t in .carry/bin/test_*; do
  name=$(basename "$t")
  # (Catch2 v2's --list exits with the number of tests, so read its output, not its status.)
  [ -n "$("$t" --list-test-names-only "$spec" 2>/dev/null)" ] || continue
  "$t" "$spec" >"$OUT/$name.log" 2>&1 &
  pids[$name]=$!
done
status=0
for name in $(printf '%s\n' "${!pids[@]}" | sort); do
  wait "${pids[$name]}"; rc=$?
  echo "== $name $spec (rc $rc)"
  tail -n 2 "$OUT/$name.log"
  [ $rc = 0 ] || status=1
done
exit $status
