#!/usr/bin/env bash
# One device call for KIE's GPU engine: install the carried wheels (.whl/), build
# (objects carried in build/ are reused when their stamps match: see
# kccl/_build_cuda.py), then run the steps given, in order:
#   check1      tests/gpu/kie_check.py with one rank (TP = 1)
#   check2      the same with 2 ranks: a GPU each, or both on GPU 0 under MPS
#   mono        tests/gpu/mono_check.py: the monokernel against the graph path, bit for bit (TP = 1)
#   mono2       the same with 2 ranks (TP = 2, the lanes' sums inside the kernel): a GPU each, or both
#               on GPU 0 under MPS
#   failures    tests/gpu/kie_failures.py: a lane killed, aborted or stalled mid-generation (graph and
#               monokernel), non-finite logits (a GPU per lane, or MPS on 1 GPU)
#   monofail    the same, the monokernel's scenarios only
#   monotp      mono2 then monofail, with one PASS/FAIL line per step at the end
#   bench       bench/decode_gpu.py, TP = 1 (PyTorch baseline compiled; BASELINE= to change)
#   bench2      bench/decode_gpu.py with 2 ranks (needs two GPUs)
#   cli         python -m kie_engine generate --device cuda, one rank and two
#   sanitize    compute-sanitizer memcheck and racecheck on the tiny preset (TP = 1), graph then mono (MONO_ARGS,
#               e.g. "--attentions items", narrows the monokernel's cases; KCCL_NVCC_LINEINFO=1 builds with
#               source lines for the reports)
#   racemono    racecheck alone on the monokernel (MONO_ARGS as above), its hazards' source lines and counts
#   serve       tests/gpu/serve_check.py: generate and serve --device cuda on an init checkpoint (SERVE_CONFIG,
#               default 2b), streamed request, non-finite logits, a dead lane (two lanes under MPS)
#   ncugraph    Nsight Compute's time and DRAM bytes of each kernel of one graph decode step (2b, context
#               128 and 1024), summed by op (bench/gpu/kie_profile.py)
#   ncupf       Nsight Compute's speed-of-light, memory, warp-state and occupancy sections of the batched
#               prefill's attention kernel (2b, 1,024 tokens, the middle layer's launch: the last one
#               runs only the last row)
#   ncumono     Nsight Compute's speed-of-light, memory and warp-state sections of one monokernel step, with
#               each stall reason's warps per issue (no_instruction: code fetched from L2 at a stage's start)
#   ncustall    where the warps of one decode step stall, in place (caches not flushed): the monokernel per
#               SASS instruction (ncu_source_mono.csv.gz: each instruction's stall samples), the graph step
#               as one workload (each stall reason's warps per issue, all its kernels together)
#   pollstream  bench/gpu/poll_stream.cu: a signal between two SMs (an L2 counter, or another cluster block's
#               shared memory) while the other SMs, or they too, keep 32-128 KB of bulk copies in flight
#   smshare     bench/gpu/sm_share.cu: whether each SM's share of HBM under the weight stream is the same from
#               one launch to the next, and a stage's makespan with its bytes split by the SMs' measured speeds
# Logs and JSON go to $LOGS; after each step $OUT/kie_logs.tgz holds all of them.
#   bash bench/gpu/kie_run.sh check1 bench check2
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export KCCL_TIMEOUT_MS=${KCCL_TIMEOUT_MS:-20000}
OUT=${OUT:-/tmp/out}; LOGS=${LOGS:-/tmp/kie_logs}; mkdir -p "$OUT" "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOGS/gpus.txt"
t0=$(date +%s)
python3 setup.py -q build_ext --inplace > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
grep -E " in [0-9]+ s" "$LOGS/build.log"; echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import kccl, kie_engine.gpu.engine as g; print('kccl gpu', kccl.gpu_support(), 'kie gpu', g.gpu_built(), g.device_count())" || exit 1
NG=$(nvidia-smi -L | wc -l)
MPI="mpiexec --oversubscribe --allow-run-as-root --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x KCCL_TIMEOUT_MS -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY"
mps_on() {
  [ "$NG" -ge 2 ] && return 0
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS started" && MPS=1
}
mps_off() { [ -n "${MPS:-}" ] && echo quit | nvidia-cuda-mps-control; unset MPS; sleep 1; }
trap 'mps_off' EXIT
for s in "$@"; do
  echo "=== $s ($(date +%T))"
  case $s in
    check1) timeout 400 python3 tests/gpu/kie_check.py --json "$LOGS/kie_check_tp1.json" 2>&1 | tee "$LOGS/check1.log" | grep -v "^  (" | tail -60 ;;
    check2) mps_on; timeout 400 $MPI -n 2 python3 tests/gpu/kie_check.py --no-hf --json "$LOGS/kie_check_tp2.json" 2>&1 | tee "$LOGS/check2.log" | tail -40; mps_off ;;
    failures) mps_on; timeout 400 python3 tests/gpu/kie_failures.py 2>&1 | tee "$LOGS/failures.log" | tail -16; mps_off ;;
    monofail) mps_on; timeout 300 python3 tests/gpu/kie_failures.py kill_mono abort_mono kill_mono_d0 stall_mono nan_mono 2>&1 | tee "$LOGS/monofail.log" | tail -8; mps_off ;;
    mono) timeout 240 python3 tests/gpu/mono_check.py ${MONO_ARGS:-} --json "$LOGS/mono_check.json" 2>&1 | tee "$LOGS/mono.log" | tail -40 ;;
    mono2) mps_on; timeout 400 $MPI -n 2 python3 tests/gpu/mono_check.py ${MONO_ARGS:-} --json "$LOGS/mono_check_tp2.json" 2>&1 | tee "$LOGS/mono2.log" | tail -50; mps_off ;;
    monotp)
      mps_on
      timeout 400 $MPI -n 2 python3 tests/gpu/mono_check.py ${MONO_ARGS:-} --json "$LOGS/mono_check_tp2.json" > "$LOGS/mono2.log" 2>&1
      grep -E "^(ok  |FAIL)|MONO CHECK" "$LOGS/mono2.log" | tail -60
      timeout 300 python3 tests/gpu/kie_failures.py kill_mono abort_mono kill_mono_d0 stall_mono nan_mono > "$LOGS/monofail.log" 2>&1
      grep -E "^(PASS|FAIL)|KIE GPU FAILURES" "$LOGS/monofail.log"
      mps_off
      grep -q "MONO CHECK (tp=2): [0-9]* passed, 0 failed" "$LOGS/mono2.log" && echo "PASS mono2 (TP = 2 monokernel vs graph)" || echo "FAIL mono2 (TP = 2 monokernel vs graph): see mono2.log"
      grep -q "KIE GPU FAILURES: [0-9]* passed, 0 failed" "$LOGS/monofail.log" && echo "PASS monofail (monokernel failures)" || echo "FAIL monofail (monokernel failures): see monofail.log" ;;
    bench) timeout 560 python3 bench/decode_gpu.py --baseline ${BASELINE:-compile} ${BENCH_ARGS:-} --json "$LOGS/decode_gpu_tp1.json" 2>&1 | tee "$LOGS/bench.log" | tail -40 ;;
    bench2) timeout 560 $MPI -n 2 python3 bench/decode_gpu.py --baseline ${BASELINE:-compile} ${BENCH_ARGS:-} --json "$LOGS/decode_gpu_tp2.json" 2>&1 | tee "$LOGS/bench2.log" | tail -40 ;;
    cli) # the command line, end to end: one rank, then two (a GPU each, or one under MPS)
      python3 -m kie_engine init --config small --dtp-delay 1 --out /tmp/kie_small > /dev/null &&
        timeout 120 python3 -m kie_engine generate --model /tmp/kie_small --prompt "def fib(" --max-new-tokens 48 --ignore-eos --device cuda 2>&1 | tee "$LOGS/cli1.log" | tail -3
      mps_on; timeout 120 $MPI -n 2 python3 -m kie_engine generate --model /tmp/kie_small --prompt "def fib(" --max-new-tokens 48 --ignore-eos --device cuda 2>&1 | tee "$LOGS/cli2.log" | tail -3
      timeout 60 python3 -m kie_engine generate --model /tmp/kie_small --prompt "x" --max-new-tokens 100000 --device cuda 2>&1 | tail -2
      mps_off ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 300 compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/kie_check.py --presets tiny --steps 8 --no-hf 2>&1 | tee "$LOGS/sanitize_$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|KIE GPU CHECK|Invalid|Race" | head -12
        timeout 300 compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/mono_check.py --presets tiny --steps 8 ${MONO_ARGS:-} 2>&1 | tee "$LOGS/sanitize_mono_$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|MONO CHECK|Invalid|Race" | head -12
      done ;;
    racemono) # its waits' bound raised: under the tool the kernel runs far slower than the default 2 s allows
      KIE_GPU_MONO_WAIT_MS=400000 timeout ${RACE_S:-480} compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 1000000 python3 tests/gpu/mono_check.py --presets tiny --steps 4 ${MONO_ARGS:-} > "$LOGS/racecheck_mono.log" 2>&1
      grep -E "RACECHECK SUMMARY|MONO CHECK" "$LOGS/racecheck_mono.log"
      # each hazard's kind and its two accesses' source lines, counted
      awk '/Potential .* hazard/ {k=$4; n=2; s=""; next} n>0 && / at / {sub(/.* in /, ""); s=s " " $0; if (--n == 0) c[k s]++} END {for (x in c) print c[x], x}' "$LOGS/racecheck_mono.log" | sort -rn | head -30 ;;
    serve) # generate and serve --device cuda end to end (tests/gpu/serve_check.py), MPS on for its two lanes
      export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
      mps_on; timeout 500 python3 tests/gpu/serve_check.py --config ${SERVE_CONFIG:-2b} 2>&1 | tee "$LOGS/serve.log" | grep -E "^(PASS|FAIL)|KIE GPU SERVE"; mps_off ;;
    ncugraph)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for ctx in 128 1024; do
        timeout 300 "$NCU" --profile-from-start off --graph-profiling node --clock-control none --csv --page raw \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum python3 bench/gpu/kie_profile.py --kernel graph \
          --context $ctx > "$LOGS/ncu_graph_ctx$ctx.csv" 2> "$LOGS/ncu_graph_ctx$ctx.err"
        echo "graph step, context $ctx, each kernel alone:"; python3 bench/gpu/kie_profile.py --summarize "$LOGS/ncu_graph_ctx$ctx.csv"
      done ;;
    ncupf) # PF_SHAPES: shapes to profile beside the default, each one's settings joined by ':', e.g.
           # PF_SHAPES="KIE_GPU_PREFILL_ATTN_KEYS=64 KIE_GPU_PREFILL_ATTN=1:KIE_GPU_PREFILL_ATTN_KEYS=64"
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for shape in default ${PF_SHAPES:-}; do
        tag=${shape//[^A-Za-z0-9=]/_}
        env $([ "$shape" = default ] || echo "${shape//:/ }") timeout 300 "$NCU" --profile-from-start off --clock-control none \
          -k regex:"k_pf_(attention|wide)" --launch-skip ${PF_LAUNCH_SKIP:-13} --launch-count 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
          --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats --print-details all \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 bench/gpu/kie_profile.py --prefill --context ${PF_CONTEXT:-1024} > "$LOGS/ncu_pf_attention_$tag.txt" 2>&1
        echo "--- $shape"
        grep -E "Duration|Registers|Active Warps|Issued Warp|warps_issue_stalled" "$LOGS/ncu_pf_attention_$tag.txt" |
          awk '$NF+0 >= 0.05 || !/stalled/' | head -40
      done ;;
    ncumono)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 400 "$NCU" --profile-from-start off --clock-control none -k regex:k_mono --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --section Occupancy --section SchedulerStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 bench/gpu/kie_profile.py --kernel mono --context 128 > "$LOGS/ncu_mono.txt" 2>&1
      grep -E "Duration|DRAM Throughput|Memory Throughput|Stall|Warp Cycles|Registers|Shared Memory|Block Limit|Achieved|L2 Hit|Issued" "$LOGS/ncu_mono.txt" | head -40
      grep -E "warps_issue_stalled" "$LOGS/ncu_mono.txt" | awk '$NF+0 >= 0.05' ;;
    ncustall)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
      timeout 200 "$NCU" --profile-from-start off --clock-control none --cache-control none -k regex:k_mono \
        --launch-count 1 --section WarpStateStats --section SourceCounters --section SpeedOfLight --metrics "$STALLS" \
        -o "$LOGS/ncu_mono_stalls" -f python3 bench/gpu/kie_profile.py --kernel mono --context 128 \
        > "$LOGS/ncu_mono_stalls.log" 2>&1
      "$NCU" --import "$LOGS/ncu_mono_stalls.ncu-rep" --page details --print-details all > "$LOGS/ncu_mono_stalls.txt" 2>&1
      "$NCU" --import "$LOGS/ncu_mono_stalls.ncu-rep" --page source --csv --print-source sass 2>&1 |
        gzip > "$LOGS/ncu_source_mono.csv.gz"
      grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued" "$LOGS/ncu_mono_stalls.txt" | head -8
      grep -E "warps_issue_stalled" "$LOGS/ncu_mono_stalls.txt" | awk '$NF+0 >= 0.05'
      rm -f "$LOGS/ncu_mono_stalls.ncu-rep"
      timeout 200 "$NCU" --profile-from-start off --clock-control none --cache-control none --graph-profiling graph \
        --launch-count 1 --section WarpStateStats --section SpeedOfLight --metrics "$STALLS" \
        python3 bench/gpu/kie_profile.py --kernel graph --context 128 > "$LOGS/ncu_graph_stalls.txt" 2>&1
      grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued|==ERROR|==WARNING" "$LOGS/ncu_graph_stalls.txt" | head -8
      grep -E "warps_issue_stalled" "$LOGS/ncu_graph_stalls.txt" | awk '$NF+0 >= 0.05' ;;
    pollstream)
      nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ikie_engine/gpu/csrc -o /tmp/poll_stream bench/gpu/poll_stream.cu &&
        OUT=$LOGS timeout 120 /tmp/poll_stream 2>&1 | tee "$LOGS/poll_stream.log" ;;
    smshare)
      nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ikie_engine/gpu/csrc -o /tmp/sm_share bench/gpu/sm_share.cu &&
        OUT=$LOGS timeout 120 /tmp/sm_share ${SMSHARE_ARGS:-} 2>&1 | tee -a "$LOGS/sm_share.log" ;;
    *) echo "unknown step $s" ;;
  esac
  tar czf "$OUT/kie_logs.tgz" -C "$LOGS" . 2>/dev/null
done
echo "total: $(( $(date +%s) - t0 )) s"
