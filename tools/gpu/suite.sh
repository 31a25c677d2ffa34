#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, after tools/gpu/pack.sh staged .carry/ here:
# the [gpu] tests of every test binary, then the benchmarks (flexc's and PyTorch's peers in the
# same run). Logs go to $OUT (default ./out). Optional $1: a Catch2 test spec instead of [gpu].
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
export FLEXC_CACHE_DIR=/tmp/flexc-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
spec=${1:-[gpu]}
status=0
for t in .carry/bin/test_*; do
  name=$(basename "$t")
  # (Catch2 v2's --list exits with the number of tests, so read its output, not its status.)
  [ -n "$("$t" --list-test-names-only "$spec" 2>/dev/null)" ] || continue
  echo "== $name $spec"
  "$t" "$spec" >"/tmp/$name.log" 2>&1; rc=$?; cat "/tmp/$name.log" >>"$OUT/gpu_tests.log"
  tail -n 3 "/tmp/$name.log"
  [ $rc = 0 ] || status=1
done
exit $status
