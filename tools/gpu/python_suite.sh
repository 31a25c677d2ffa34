#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, after `WHEEL_PYTHON=python3.12 bash tools/gpu/pack.sh`
# staged the flexc wheel (for the device's Python) in .carry/wheel: installs it into /tmp/site
# without an index (the device reaches none; torch, numpy and nvidia-cuda-nvrtc are there), runs
# python/tests (the torch layer against torch's flex_attention, on the GPU) and the call-overhead
# benchmark. Logs to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheel/flexc-*.whl || exit 1
export PYTHONPATH=/tmp/site FLEXC_CACHE_DIR=${FLEXC_CACHE_DIR:-/tmp/flexc-cache}
python3 -m pytest -rs -s -p no:cacheprovider python/tests 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
python3 examples/python_quickstart.py 2>&1 | tee "$OUT/quickstart.txt"
status=$(( status | PIPESTATUS[0] ))
python3 tools/bench_python_overhead.py --cpp .carry/bin/bench_call_overhead 2>&1 | tee "$OUT/overhead.txt"
exit $status
