#!/usr/bin/env bash
# One call on the H200 device machine: build KCCL there, start MPS, then run
# the given steps (default: all).  Output goes to stdout and $LOGS/*; after each
# step $OUT/logs.tgz holds all of $LOGS (the device tool returns at most 8 files).
#   bash bench/gpu/device_run.sh check2 check8 failures bench8 ...
# The device image has no cffi: carry its wheels (.whl/: cffi 2.0.0 and pycparser, see bench/RESULTS.md "GPU machine"), which
# this script installs when present.
set -u
export KCCL_TIMEOUT_MS=${KCCL_TIMEOUT_MS:-10000} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; LOGS=${LOGS:-/tmp/kccl_logs}; mkdir -p "$OUT" "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
# A/B against an earlier commit: .ab/base.tar (git archive of it, untracked, carried) is
# built in /tmp/base beside this tree; a step base:STEP runs STEP there, logs in $LOGS/base.
if [ -f .ab/base.tar ]; then
  rm -rf /tmp/base && mkdir -p /tmp/base "$LOGS/base" && tar xf .ab/base.tar -C /tmp/base &&
    (cd /tmp/base && python3 setup.py -q build_ext --inplace > "$LOGS/base/build.log" 2>&1) &
  base_build=$!
fi
python3 setup.py -q build_ext --inplace > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
if [ -n "${base_build:-}" ]; then
  wait $base_build || { echo "base build failed"; tail -20 "$LOGS/base/build.log"; }
  cat /tmp/base/.ab_ref 2>/dev/null
fi
python3 -c "import kccl; print('kccl gpu support:', kccl.gpu_support())" || exit 1
# The benchmark extension (bench/native) once, here, rather than inside a step's timeout.
python3 bench/native/build.py > "$LOGS/bench_build.log" 2>&1 || { tail -40 "$LOGS/bench_build.log"; exit 1; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
MPI="mpiexec --oversubscribe --allow-run-as-root --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x KCCL_TIMEOUT_MS -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY"
[ -n "${CUDA_MODULE_LOADING:-}" ] && MPI="$MPI -x CUDA_MODULE_LOADING"
steps=${*:-check2 failures check8 bench2 bench8}
run_step() {
  local s=$1
  case $s in
    check[0-9]*) n=${s#check}; timeout 150 $MPI -n $n python3 tests/gpu/mpi_check.py --quick 2>&1 | tee "$LOGS/$s${LOGTAG:-}.log" | tail -25 ;;
    fullcheck[0-9]*) n=${s#fullcheck}; timeout 400 $MPI -n $n python3 tests/gpu/mpi_check.py 2>&1 | tee "$LOGS/$s.log" | tail -25 ;;
    failures) timeout 400 python3 tests/gpu/failures.py 2>&1 | tee "$LOGS/failures.log" | tail -12 ;;
    small[0-9]*) n=${s#small}; timeout 200 $MPI -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 4 -e 256K -r 20 --json "$LOGS/gpu_bench_${n}ranks_small${LOGTAG:-}.json" 2>&1 | tee "$LOGS/$s${LOGTAG:-}.log" | grep -v Traceback | tail -32 ;;
    pdlcheck[0-9]*) n=${s#pdlcheck}; KCCL_GPU_PDL=1 timeout 150 $MPI -x KCCL_GPU_PDL -n $n python3 tests/gpu/mpi_check.py --quick 2>&1 | tee "$LOGS/$s.log" | tail -8 ;;
    pdlsmall[0-9]*) n=${s#pdlsmall}; KCCL_GPU_PDL=1 timeout 200 $MPI -x KCCL_GPU_PDL -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 4 -e 256K -r 20 --json "$LOGS/gpu_bench_${n}ranks_pdl.json" 2>&1 | tee "$LOGS/$s.log" | grep -v Traceback | tail -32 ;;
    ts[0-9]*) n=${s#ts}; KCCL_ALGO=twoshot timeout 200 $MPI -x KCCL_ALGO -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 1K -e 1M -r 20 --json "$LOGS/gpu_bench_${n}ranks_twoshot.json" 2>&1 | tee "$LOGS/$s.log" | grep -v Traceback | grep -v "^# device API" | tail -14 ;;
    nopdllarge[0-9]*) n=${s#nopdllarge}; KCCL_GPU_PDL=0 timeout 200 $MPI -x KCCL_GPU_PDL -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 512K -e 64M -r 10 --json "$LOGS/gpu_bench_${n}ranks_large_nopdl.json" 2>&1 | tee "$LOGS/$s.log" | grep -v Traceback | tail -16 ;;
    large[0-9]*) n=${s#large}; timeout 200 $MPI -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 512K -e 64M -r 10 --json "$LOGS/gpu_bench_${n}ranks_large.json" 2>&1 | tee "$LOGS/$s.log" | grep -v Traceback | tail -16 ;;
    nopdl[0-9]*) n=${s#nopdl}; KCCL_GPU_PDL=0 timeout 200 $MPI -x KCCL_GPU_PDL -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 4 -e 256K -r 20 --json "$LOGS/gpu_bench_${n}ranks_nopdl.json" 2>&1 | tee "$LOGS/$s.log" | grep -v Traceback | tail -30 ;;
    bench[0-9]*) n=${s#bench}; timeout 300 $MPI -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 4 -e 64M -r 20 --json "$LOGS/gpu_bench_${n}ranks.json" 2>&1 | tee "$LOGS/$s.log" | tail -40 ;;
    sanitize|sanitize[0-9]*) n=${s#sanitize}; n=${n:-2} # sanitizeN: N ranks (sanitize: 2)
              for tool in memcheck racecheck; do
                timeout 200 $MPI -n $n compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/mpi_check.py --quick --tiny 2>&1 | tee "$LOGS/${s}_$tool${LOGTAG:-}.log" | grep -E "ERROR SUMMARY|GPU CHECK|error" | head -12
              done ;;
    multigpu) # issue 6: one rank per GPU, KCCL vs NCCL on the same buffers (needs an -x2/-x4/-x8 kind)
      nvidia-smi topo -m | tee "$LOGS/topo.txt"
      ng=$(nvidia-smi -L | wc -l)
      for n in 2 4 8; do
        [ "$n" -le "$ng" ] || continue
        for dt in bfloat16 float32; do
          timeout 280 $MPI -n $n python3 bench/allreduce.py --device cuda --compare nccl -d $dt -b 4 -e 256M -r 20 \
            --json "$LOGS/multigpu_${n}gpus_${dt}.json" 2>&1 | tee "$LOGS/multigpu_${n}_${dt}.log" | grep -v Traceback | tail -40
        done
      done ;;
    nccltests) # NVIDIA's nccl-tests in the same call, plain and symmetric (-R 2), in graphs; carry
      # [".nccl-tests"] (a copy of ../shared/nccl-tests: see ../shared/NCCL-TESTS.md)
      D=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])")
      mkdir -p /tmp/ncclhome/lib && ln -sfn $D/include /tmp/ncclhome/include && ln -sf $D/lib/libnccl.so.2 /tmp/ncclhome/lib/libnccl.so &&
        ln -sf $D/lib/libnccl.so.2 /tmp/ncclhome/lib/
      export LD_LIBRARY_PATH=/tmp/ncclhome/lib:${LD_LIBRARY_PATH:-}
      make -j16 -C .nccl-tests/src BUILDDIR=/tmp/nt NCCL_HOME=/tmp/ncclhome CUDA_HOME=/usr/local/cuda \
        NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" > "$LOGS/nccltests_build.log" 2>&1 || { tail -20 "$LOGS/nccltests_build.log"; return; }
      ng=$(nvidia-smi -L | wc -l)
      for dt in bfloat16 float; do
        for R in 0 2; do
          timeout 200 /tmp/nt/all_reduce_perf -b 4 -e 256M -f 2 -g $ng -d $dt -w 20 -n 200 -G 100 -R $R 2>&1 |
            tee "$LOGS/nccltests_${ng}gpus_${dt}_R$R.log" | tail -34
        done
      done ;;
    ncclshim) # issue 27: torch.distributed with and without libkccl_nccl.so preloaded, bitwise, eager and graphs
      # (a GPU per rank, so without MPS: nothing of NCCL's is measured through it)
      echo quit | nvidia-cuda-mps-control; sleep 1
      MPIEXEC="$MPI" timeout 500 python3 tests/gpu/nccl_shim_check.py --np 2 2>&1 | tee "$LOGS/ncclshim.log" | tail -40
      nvidia-cuda-mps-control -d ;;
    shimbench) # issue 27: PyTorch TP=2 decode (2b) with plain NCCL and with the shim, in one call, without MPS
      echo quit | nvidia-cuda-mps-control; sleep 1
      MPIEXEC="$MPI" timeout 550 python3 bench/nccl_shim_decode.py --np 2 --json "$LOGS/nccl_shim_decode.json" \
        -- --baseline graph --kernels graph --delays 0 --contexts 128,1024 --rounds 3 2>&1 | tee "$LOGS/shimbench.log" | tail -30
      nvidia-cuda-mps-control -d ;;
    replica[0-9]*) n=${s#replica}; timeout 200 $MPI -n $n python3 bench/gpu/replica_ab.py --json "$LOGS/replica_${n}ranks.json" 2>&1 | tee "$LOGS/$s.log" | grep -v Traceback | tail -24 ;;
    foreign[0-9]*) # residency with the last rank 50 ms late and an own kernel of its before the probe
      n=${s#foreign}; [ "$n" -gt 4 ] && list="${FBLOCKS8:-12,16,17,18,19,20,22,26,33}" || list="${FBLOCKS2:-64,99,116,128,131,132}"
      for f in 0 1 2; do
        timeout 120 $MPI -n $n python3 bench/gpu/residency.py --blocks $list --late-ms 50 --timeout-ms 500 --foreign $f --carveout ${CARVE:--1} \
          --json "$LOGS/residency_${n}ranks_foreign$f.json" 2>&1 | tee "$LOGS/${s}_$f.log" | tail -12
      done ;;
    residency[0-9]*) n=${s#residency}; timeout 120 $MPI -n $n python3 bench/gpu/residency.py --json "$LOGS/residency_${n}ranks.json" 2>&1 | tee "$LOGS/$s.log" | tail -16 ;;
    ladderlib) # only the library's rungs (push / pull, one hop / two), 4 and 8 ranks, three rounds each
      nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ikccl_native/include -o /tmp/ll_ladder bench/gpu/ll_ladder.cu &&
        for r in 4 8; do timeout 100 /tmp/ll_ladder 2000 $r 0 lib; done 2>&1 | tee "$LOGS/$s.log" ;;
    flagladder) # session 13: plain data behind flags against the LL exchange (ll_ladder.cu flagx), 2 / 4 / 8 ranks
      nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ikccl_native/include -o /tmp/ll_ladder bench/gpu/ll_ladder.cu &&
        for r in 2 4 8; do timeout 100 /tmp/ll_ladder 2000 $r 0 flag; done 2>&1 | tee "$LOGS/$s.log" ;;
    ladder|ladder[0-9]*) # ladderN: only N ranks (ladder: 2, 4 and 8)
      r=${s#ladder}; nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ikccl_native/include -o /tmp/ll_ladder bench/gpu/ll_ladder.cu &&
            timeout 120 /tmp/ll_ladder 2000 ${r:-0} 2>&1 | tee "$LOGS/$s.log" ;;
    nculadder) # stall reasons of the ladder's variants (ncu does not profile MPS clients: MPS is stopped meanwhile)
      echo quit | nvidia-cuda-mps-control; sleep 2
      for r in 2 8; do
        timeout 150 ncu --section WarpStateStats --section LaunchStats --metrics smsp__inst_executed.sum,gpu__time_duration.sum \
          --page raw --csv -k regex:k_ladder /tmp/ll_ladder 300 $r 256 > "$LOGS/ncu_ladder_$r.csv" 2> "$LOGS/ncu_ladder_$r.err"
        tail -3 "$LOGS/ncu_ladder_$r.err"
      done
      nvidia-cuda-mps-control -d && echo "MPS restarted" ;;
    launchfloor) timeout 200 sh bench/gpu/run_launch_floor.sh 2>&1 | tee "$LOGS/launchfloor.log" | tail -60 ;;
    fullshare*) # the chunked kernels with twice the default blocks (timed out in session 6), PDL on / off
      n=${s#fullshare}; n=${n%%[a-z]*}; b=$((264 / n)); what=${s#fullshare$n}
      for pdl in 0 1; do
        echo "--- KCCL_GPU_BLOCKS=$b KCCL_GPU_PDL=$pdl ${what:-check}"
        if [ "$what" = large ]; then
          KCCL_GPU_BLOCKS=$b KCCL_GPU_PDL=$pdl timeout 150 $MPI -x KCCL_GPU_BLOCKS -x KCCL_GPU_PDL -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 1M -e 64M -f 4 -r 5 \
            2>&1 | tee "$LOGS/${s}_pdl$pdl.log" | grep -E "^ +[0-9]+M|rror:" | head -6
        else
          KCCL_GPU_BLOCKS=$b KCCL_GPU_PDL=$pdl timeout 150 $MPI -x KCCL_GPU_BLOCKS -x KCCL_GPU_PDL -n $n python3 tests/gpu/mpi_check.py --quick 2>&1 | tee "$LOGS/${s}_pdl$pdl.log" | grep -E "GPU CHECK|rror:" | head -3
        fi
      done ;;
    blockcounts[0-9]*) n=${s#blockcounts}; [ "$n" -gt 4 ] && list="${BCOUNTS8:-}" || list="${BCOUNTS2:-}"
      timeout 200 $MPI -n $n python3 tests/gpu/block_counts.py $list 2>&1 | tee "$LOGS/$s.log" | grep -v "^ *File\|^    " | tail -20 ;;
    pushcheck[0-9]*) n=${s#pushcheck}; KCCL_GPU_PULL=0 timeout 150 $MPI -x KCCL_GPU_PULL -n $n python3 tests/gpu/mpi_check.py --quick 2>&1 | tee "$LOGS/$s.log" | tail -8 ;;
    nopdlcheck[0-9]*) n=${s#nopdlcheck}; KCCL_GPU_PDL=0 timeout 150 $MPI -x KCCL_GPU_PDL -n $n python3 tests/gpu/mpi_check.py --quick 2>&1 | tee "$LOGS/$s.log" | tail -8 ;;
    blocks[0-9]*) # 64 MB with several chunked-kernel block counts (KCCL_GPU_BLOCKS; 0 = auto)
      n=${s#blocks}; [ "$n" -gt 4 ] && list="${BLOCKS8:-0 18 26 40}" || list="${BLOCKS2:-0 74 99}"
      list=${list//,/ } # env:BLOCKS8=12,16,0 sets the list from within the steps
      for b in $list; do
        echo "--- KCCL_GPU_BLOCKS=$b"
        KCCL_GPU_BLOCKS=$b timeout 120 $MPI -x KCCL_GPU_BLOCKS -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 64M -e 64M -r 5 \
          --json "$LOGS/gpu_bench_${n}ranks_blocks$b${LOGTAG:-}.json" 2>&1 | tee "$LOGS/${s}_$b${LOGTAG:-}.log" | grep -E "^ +64M|copy bandwidth|64M: two-shot|Error|rror:" | head -6
      done ;;
    ab[0-9]*) # one-shot pull (auto on one GPU) against push, 2 KB - 32 KB, alternating twice
      n=${s#ab}
      for i in 1 2; do
        for pull in 1 0; do
          echo "--- KCCL_GPU_PULL=$pull (round $i)"
          KCCL_GPU_PULL=$pull timeout 120 $MPI -x KCCL_GPU_PULL -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 2K -e 32K -r 10 \
            --json "$LOGS/gpu_bench_${n}ranks_pull${pull}_$i.json" 2>&1 | tee "$LOGS/${s}_pull${pull}_$i.log" | grep -v Traceback | grep -E "^ +[0-9]|device API 8K|rror" | head -14
        done
      done ;;
    mid[0-9]*) # the one-shot's upper sizes, with and without PDL
      n=${s#mid}
      for pdl in 1 0; do
        echo "--- KCCL_GPU_PDL=$pdl"
        KCCL_GPU_PDL=$pdl timeout 120 $MPI -x KCCL_GPU_PDL -n $n python3 bench/allreduce.py --device cuda -d bfloat16 -b 32K -e 256K -r 10 \
          --json "$LOGS/gpu_bench_${n}ranks_mid_pdl$pdl.json" 2>&1 | tee "$LOGS/${s}_pdl$pdl.log" | grep -v Traceback | grep -v "^# device API" | tail -9
      done ;;
    l2poll) [ -f bench/gpu/run_l2_poll.sh ] && timeout 200 bash bench/gpu/run_l2_poll.sh 2>&1 | tee "$LOGS/l2poll.log" | tail -30 ;;
    *) echo "unknown step $s" ;;
  esac
}
for s in $steps; do
  echo "=== $s $(date +%T)"
  case $s in
    env:*=*) # env:NAME=VALUE: set NAME for the steps after this one (and pass it to the ranks)
      kv=${s#env:}; export "${kv%%=*}=${kv#*=}"; MPI="$MPI -x ${kv%%=*}"; echo "${kv%%=*}=${kv#*=} from here on"
      LOGTAG="${LOGTAG:-}_$(printf %s "$kv" | tr -c 'A-Za-z0-9' _)" ;; # small / check logs of later steps get this tag
    base:*) [ -d /tmp/base ] || { echo "no base tree (.ab/base.tar)"; continue; }
      (cd /tmp/base && export PYTHONPATH=/tmp/site:/tmp/base LOGS="$LOGS/base" && run_step "${s#base:}") ;;
    *) run_step "$s" ;;
  esac
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
done
