#!/bin/sh
# Builds and runs bench/gpu/launch_floor.cu (run it with MPS started, as device_run.sh does):
# the memory-latency table, then the launch floor with 1, 2, 4 and 8 concurrent MPS clients.
#   sh bench/gpu/run_launch_floor.sh
set -e
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD_DIR:-${TMPDIR:-/tmp}/kccl-launch-floor}
mkdir -p "$build"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o "$build/launch_floor" "$here/launch_floor.cu"
timeout 60 "$build/launch_floor" mem
for cfg in "0 0" "0 4" "1 4"; do
  set -- $cfg
  for n in 1 2 4 8; do
    start=$(( $(date +%s%3N) + 1500 ))
    echo "# $n clients at once, pdl=$1 blocks=$2"
    i=0
    while [ $i -lt $n ]; do
      timeout 30 "$build/launch_floor" launch $start 2000 $1 $2 1.0 | sed "s/^/  client $i: /" &
      i=$((i + 1))
    done
    wait
  done
done
