#!/usr/bin/env bash
# Builds the standalone forward-kernel harness for a matrix of variants and configurations with
# nvcc (in parallel), runs the correctness checks, then the timings. For the device machine:
#   bash tools/dev/run_matrix.sh [check|bench|all]   (logs under $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
bin=/tmp/fwd_dev; mkdir -p "$bin"
log=${OUT:-/tmp}/fwd_dev.log; : >"$log"
arch=${ARCH:-sm_90}

# name: variant D bf16 BM BN warps stages
checks=(
  "0 128 1 128 64 4 2" "1 128 1 128 64 4 2" "2 128 1 128 64 4 2" "3 128 1 128 64 4 2"
  "4 128 1 128 64 4 2" "5 128 1 128 64 4 2" "6 128 1 128 64 4 2" "7 128 1 128 64 4 2"
  "1 128 0 128 64 4 2" "7 128 0 128 64 4 2" "0 64 1 128 64 4 2" "1 64 1 128 64 4 2"
  "7 64 1 128 64 4 2" "7 64 0 128 64 4 2" "1 32 1 128 64 4 2" "7 32 1 128 64 4 2"
  "1 96 1 64 64 4 2" "7 96 1 64 64 4 2" "1 256 1 128 32 8 2" "7 256 1 64 32 4 2"
  "7 128 1 128 64 8 2" "7 128 1 64 64 4 2" "7 128 1 128 32 4 2" "7 64 1 128 128 8 2"
)
benches=()
for cfg in "128 64 4 2"; do
  benches+=("0 128 1 $cfg" "1 128 1 $cfg" "0 64 1 $cfg" "1 64 1 $cfg")
done
variants=()
for v in 2 3 4 5 6; do variants+=("$v 128 1 128 64 4 2"); done

name() { set -- $1; echo "v$1_d$2_b$3_m$4_n$5_w$6_s$7"; }
build() {
  set -- $1
  local n; n=$(name "$*")
  [ -x "$bin/$n" ] || nvcc -std=c++17 -O3 -arch=$arch -Itemplates -Itemplates/tile -Itemplates/attention -Itools/dev -DFLEXC_DEV_VARIANT=$1 \
    -DFLEXC_HEAD_DIM=$2 -DFLEXC_BF16=$3 -DFLEXC_BLOCK_M=$4 -DFLEXC_BLOCK_N=$5 -DFLEXC_WARPS=$6 \
    -DFLEXC_STAGES=$7 tools/dev/attention_fwd_dev.cu -o "$bin/$n" >>"$log" 2>&1 \
    || echo "BUILD FAILED $n" | tee -a "$log"
}
export -f build name; export bin log arch
all=("${checks[@]}" "${benches[@]}" "${variants[@]}")
t0=$(date +%s)
printf '%s\n' "${all[@]}" | sort -u | xargs -P "$(nproc)" -I{} bash -c 'build "{}"'
echo "built in $(( $(date +%s) - t0 )) s" | tee -a "$log"

if [ "$what" != bench ]; then
  printf '%s\n' "${checks[@]}" | xargs -P 4 -I{} bash -c '"$bin/$(name "{}")" check' \
    >>"$log" 2>&1
  echo "checks: $(grep -c ^PASS "$log") passed, $(grep -c ^FAIL "$log") failed"
  grep -E "^FAIL|error" "$log"
fi
if [ "$what" != check ]; then
  for c in "${benches[@]}"; do echo "cfg $c"; "$bin/$(name "$c")" bench; done >>"$log" 2>&1
  for c in "${variants[@]}"; do echo "cfg $c"; "$bin/$(name "$c")" bench16k; done >>"$log" 2>&1
  grep -E "^cfg|BENCH|FAIL" "$log" \
    | awk '/^cfg/{cfg="m" $5 " n" $6 " w" $7 " s" $8; next} /^BENCH/{$1=""} {print cfg " |" $0}'
fi
