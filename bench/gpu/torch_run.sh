#!/usr/bin/env bash
# One device call for torch.distributed's "kccl" backend on CUDA tensors: install the carried
# wheels (.whl/) if any, build KCCL (with its CUDA transport) and the c10d backend (setup.py
# builds it against the machine's torch), start MPS, run tests/gpu/torch_backend_check.py with
# 2 ranks on GPU 0 (every collective on CUDA tensors against the CPU path, bit for bit; streams;
# CUDA graphs; a mismatch), which ends with the 4 KB all_reduce latency eager and in a graph.
# Logs and JSON go to $LOGS; $OUT/torch_logs.tgz holds them.
#   bash bench/gpu/torch_run.sh            (NP=4 for four ranks)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export KCCL_TIMEOUT_MS=${KCCL_TIMEOUT_MS:-20000} KCCL_TORCH_BUILD=1
OUT=${OUT:-/tmp/out}; LOGS=${LOGS:-/tmp/torch_logs}; mkdir -p "$OUT" "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee "$LOGS/torch.txt"
t0=$(date +%s)
python3 setup.py -q build_ext --inplace > "$LOGS/build.log" 2>&1 || { tail -60 "$LOGS/build.log"; exit 1; }
grep -E "kccl.torch|GPU transport| in [0-9]+ s" "$LOGS/build.log"; echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import time, torch.distributed; t = time.perf_counter(); import kccl, kccl.torch; print('kccl gpu', kccl.gpu_support(), 'import kccl.torch %.2f s' % (time.perf_counter() - t), kccl.torch._ext.__file__)" || exit 1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
MPI="mpiexec --oversubscribe --allow-run-as-root --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x KCCL_TIMEOUT_MS -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY"
timeout 500 $MPI -n ${NP:-2} python3 tests/gpu/torch_backend_check.py --json "$LOGS/torch_gpu_check.json" 2>&1 | tee "$LOGS/torch_gpu_check.log" | grep -v "^\[" | tail -40
tar czf "$OUT/torch_logs.tgz" -C "$LOGS" .
cp "$LOGS/torch_gpu_check.json" "$OUT/" 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
