#!/usr/bin/env bash
# The CUDA checks, on a GPU machine that has PyTorch but no SGLang: the per-step gather, the per-forward
# capture path and the collection path under `set_sync_debug_mode("error")`, then the hook microbenchmark
# with the capturer on the GPU. From the repo root:
#
#   tests/engine/gpu/run_checks.sh WHEELS OUT
#
# WHEELS holds `whl/` (SGLang 0.5.23's pure-Python dependencies the machine lacks, for its Python) and
# `sglang.tar.gz` (SGLang 0.5.23's package, without its Rust extensions, which this path never loads);
# tests/engine/gpu/make_wheels.sh makes both. OUT receives the logs and `hooks_cuda.json`
# (R3_GPU_BENCH=0: the tests only).
set -uo pipefail
WHEELS=${1:?wheel folder}
OUT=${2:?output folder}
SITE=${R3_GPU_SITE:-/tmp/r3-gpu-site}
mkdir -p "$OUT" "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/whl/*.whl || exit 1
tar -xzf "$WHEELS/sglang.tar.gz" -C "$SITE" || exit 1
export PYTHONPATH="$SITE:$PWD/tests/engine/gpu:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'
} 2>&1 | tee "$OUT/machine.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/sglang/test_step_gather_cuda.py 2>&1 | tee "$OUT/step_gather.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/sglang/test_capture_sync.py::test_per_forward_path_has_no_cuda_sync \
  tests/engine/sglang/test_collect_sync.py::test_collection_reads_no_device_value_on_cuda tests/engine/sglang/test_capture_graph_cuda.py \
  2>&1 | tee "$OUT/sync.log"
[ "${R3_GPU_BENCH:-1}" = 0 ] && exit 0
timeout 360 python3 -m benchmarks.hooks --device cuda --out "$OUT/hooks_cuda.json" 2>&1 | tee "$OUT/hooks_cuda.log"
