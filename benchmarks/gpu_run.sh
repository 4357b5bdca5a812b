#!/usr/bin/env bash
# The GPU session's script (2 GPUs, NCCL): install what the image lacks from
# carried wheels, run the gradient tests on NCCL, then the benchmark for every
# schedule (one torchrun per schedule, bounded, so a hang costs one row).
# Usage on the GPU machine: bash benchmarks/gpu_run.sh [tests|bench|all] ; results under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# the project itself, built as pyproject.toml maps it (the image has setuptools)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
REPO=$PWD
(cd /tmp && python3 -c "import torch, zmq, pipeloom.runtime; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'zmq', zmq.__version__)")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
  # from outside the checkout, so the installed package (not ./pipeloom) is imported
  (cd /tmp && PIPELOOM_TEST_BACKEND=nccl timeout 300 python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" "$REPO/tests/test_runtime_gradients.py" 2>&1 | tail -25 | tee "$OUT/nccl-tests.log")
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  rm -f "$OUT/gpu.jsonl"
  for s in ${SCHEDULES:-1F1B Interleaved1F1B ZBVZeroBubble DualPipeV GPipe LoopedBFS InterleavedZeroBubble}; do
    echo "== $s"
    (cd /tmp && timeout ${BENCH_TIMEOUT:-150} torchrun --nproc-per-node 2 "$REPO/benchmarks/gpu_pipeline.py" --schedule $s --json "$OUT/gpu.jsonl" ${BENCH_ARGS:-} 2>&1 | grep -v "^\[W\|Warning\|warn" | tail -4)
  done
  for s in ${VARLEN_SCHEDULES:-1F1B ZBVZeroBubble}; do
    echo "== $s varlen"
    (cd /tmp && timeout ${BENCH_TIMEOUT:-150} torchrun --nproc-per-node 2 "$REPO/benchmarks/gpu_pipeline.py" --schedule $s --varlen --json "$OUT/gpu.jsonl" ${BENCH_ARGS:-} 2>&1 | grep -v "^\[W\|Warning\|warn" | tail -3)
  done
  python3 benchmarks/gpu_pipeline.py --table "$OUT/gpu.jsonl" | tee "$OUT/table.md"
fi
