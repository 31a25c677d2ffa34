#!/usr/bin/env bash
# Builds flexc here (Release) and stages what a GPU machine needs into .carry/ (ignored by git):
# the binaries and the one shared library the device image lacks (libfmt). The device machine
# has the CUDA 13 driver and NVRTC but not this machine's -dev packages.
#   bash tools/gpu/pack.sh            then, on the device: bash tools/gpu/suite.sh [filter]
# With WHEEL_PYTHON set (an interpreter of the device's Python version, 3.12), the flexc wheel is
# built too, into .carry/wheel: then tools/gpu/python_suite.sh runs the Python tests there.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLEXC_FUZZ=OFF >/dev/null
cmake --build build-release
rm -rf .carry && mkdir -p .carry/bin .carry/lib
find build-release -maxdepth 2 -type f -executable \( -name flexc -o -name 'test_*' -o -name 'bench_*' \) \
  -exec cp {} .carry/bin/ \;
cp -L /usr/lib/x86_64-linux-gnu/libfmt.so.9 .carry/lib/
if [ -n "${WHEEL_PYTHON:-}" ]; then
  "$WHEEL_PYTHON" -m pip wheel . --no-deps -q -w .carry/wheel -C build-dir=build-wheel
fi
du -sh .carry
