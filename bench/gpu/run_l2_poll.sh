#!/bin/sh
# Compiles and runs the H200/H100 L2-partition poll benchmark (bench/gpu/l2_poll.cu):
# one run, well under 2 minutes.  Prints the per-SM table and a summary line per load
# mode; writes $OUT/l2_poll.json (the full SM x address matrix) when OUT is set.
#   sh bench/gpu/run_l2_poll.sh [K=64] [loads=256] [reps=5]
set -e
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD_DIR:-${TMPDIR:-/tmp}/kccl-l2poll}
mkdir -p "$build"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o "$build/l2_poll" "$here/l2_poll.cu"
# bounded: a hung kernel must not eat the lead's device time
exec timeout 150 "$build/l2_poll" "$@"
