#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, after tools/gpu/pack.sh staged .carry/ here: the
# [gpu] tests of every test binary, each test case in its own process, all at once (cold, most
# of the time is NVRTC compiling kernels on the CPU; they share the JIT cache, which is safe
# across processes). Logs go to /tmp/flexc-gpu-logs, failed ones also to $OUT (default ./out).
# Optional $1: a Catch2 test spec instead of [gpu]. Each case gets $FLEXC_TEST_TIMEOUT seconds
# (default 540): a hang fails as rc 124 with its log in $OUT, not a suite that never ends. Each
# failure's log goes to $OUT as soon as its case ends, so a caller's own timeout keeps them.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}; LOGS=/tmp/flexc-gpu-logs; mkdir -p "$OUT" "$LOGS"
export LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
export FLEXC_CACHE_DIR=/tmp/flexc-cache
export FLEXC_BINARY_DIR=$PWD/.carry/bin  # the flexc that tests/test_cli.cpp runs
# Ring attention loads NCCL at run time: without a system copy, PyTorch's wheel has one.
if [ -z "${FLEXC_NCCL:-}" ] && ! ldconfig -p | grep -q libnccl.so.2; then
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -n "$nccl" ] && [ -f "$nccl" ] && export FLEXC_NCCL=$nccl
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
spec=${1:-[gpu]}
# One process per test case: the cases of one binary compile different kernels.
rm -f "$LOGS"/*.rc
jobs_run=()
n=0
for t in .carry/bin/test_*; do
  name=$(basename "$t")
  # (Catch2 v2's --list exits with the number of tests, so read its output, not its status.)
  while IFS= read -r test_case; do
    [ -n "$test_case" ] || continue
    n=$((n + 1))
    # Catch2 reads ',' in a test spec as "or": escape it.
    # Each job writes its status to a file: bash's `wait PID` loses children it reaped early.
    (timeout "${FLEXC_TEST_TIMEOUT:-540}" "$t" "${test_case//,/\\,}" >"$LOGS/$name.$n.log" 2>&1
     rc=$?; echo $rc >"$LOGS/$name.$n.rc"; [ $rc = 0 ] || cp "$LOGS/$name.$n.log" "$OUT/") &
    jobs_run+=("$name.$n")
  done < <("$t" --list-test-names-only "$spec" 2>/dev/null)
done
status=0
wait
for job in "${jobs_run[@]}"; do
  rc=$(cat "$LOGS/$job.rc" 2>/dev/null || echo "lost")
  echo "== $job (rc $rc): $(grep -m1 -E '^(All tests passed|test cases:)' "$LOGS/$job.log")"
  [ $rc = 0 ] || status=1
done
exit $status
