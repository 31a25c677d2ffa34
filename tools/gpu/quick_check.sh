#!/usr/bin/env bash
# Runs on the GPU machine after tools/gpu/pack.sh: `flexc run --check` on a few variants and shapes
# with each forward kernel, each under a time limit, so that a broken kernel shows in seconds
# (before the full [gpu] suite). Prints one verdict line per run. KERNELS (default "hopper
# portable") and CASE_TIMEOUT (seconds, default 120) adjust it.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
export FLEXC_CACHE_DIR=${FLEXC_CACHE_DIR:-/tmp/flexc-cache}
tmp=$(mktemp -d)
python3 - "$tmp" <<'PY'
import sys, numpy as np
d = sys.argv[1]
np.save(f"{d}/slope.npy", (2.0 ** (-8 * np.arange(1, 5) / 4)).astype(np.float32))
np.save(f"{d}/doc.npy", np.repeat(np.arange(3), [300, 500, 200]).astype(np.int32))
PY
status=0
for kernel in ${KERNELS:-hopper portable}; do
  while read -r variant shape extra; do
    line=$(timeout ${CASE_TIMEOUT:-120} .carry/bin/flexc run "$variant" --random "$shape" --check --kernel "$kernel" \
           ${extra//@tmp/$tmp} 2>&1 | grep -E "PASS|FAIL|rror" | head -2 | tr '\n' ' ')
    echo "$kernel $variant $shape: ${line:-no verdict (timeout or crash)}"
    [[ $line == *PASS* ]] || status=1
  done <<'CASES'
@noop 1,4,4,1000,1000,128
@causal 2,8,2,1000,777,64
@softcap 1,2,2,129,17,128
@sliding_window 1,4,4,4096,4096,128 --param window=300
@alibi 1,4,4,4096,4096,128 --capture slope=@tmp/slope.npy
@document 1,4,4,1000,1000,64 --capture doc=@tmp/doc.npy
@causal 1,4,4,300,300,128 --q-offsets 640 --kv-offset 128 --seq-lens 1200,1200 --backward
@document 1,4,2,300,250,64 --q-offsets 333 --kv-offset 333 --seq-lens 1000,1000 --capture doc=@tmp/doc.npy --backward
CASES
done
exit $status
