#!/usr/bin/env bash
# Real SGLang servers on the lent GPU, in one device call: the tiny model's upstream / mirror / sidecar
# comparison at SGLang's defaults, then the paired tok/s A/B (tests/engine/gpu/servers.py). From the repo root:
#
#   tests/engine/gpu/run_servers.sh .gpu-0.5.12    # there; carry [".gpu-0.5.12"], made here by make_wheels.sh
#
# CARRY holds `site.tar.xz` (SGLang VERSION, its slim sgl_kernel and what the image lacks) and `VERSION`.
# R3_GPU_BUDGET_S (default 330) is the driver's whole run; the A/B's rounds fill what the comparison leaves.
# Under $OUT: driver.log, results.json, gpu_servers.md (a BENCHMARKS.md fragment), logs.tar.gz (every server's
# and sidecar's log). Exit status: the driver's (1: a check failed; the log and results.json list which).
set -uo pipefail
CARRY=${1:?carry folder from make_wheels.sh}
OUT=${OUT:?set OUT to the folder the results go to}
BUDGET=${R3_GPU_BUDGET_S:-330}
VERSION=$(cat "$CARRY/VERSION") || exit 1
SITE=/tmp/r3-gpu-site-$VERSION
mkdir -p "$OUT" "$SITE"
exec > >(tee "$OUT/driver.log") 2>&1
t0=$(date +%s)
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$CARRY/site.tar.xz" "$SITE" \
  || { echo "FAIL: unpacking $CARRY/site.tar.xz"; exit 1; }
# The tree's code first (its plugin, never a copy), then the carried packages, then the image's own
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "unpacked SGLang $VERSION in $(( $(date +%s) - t0 )) s; $(nproc) CPUs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, sglang, sgl_kernel, engine_ext, service.server.api, service.server.cli, sglang.srt.entrypoints.http_server; print("torch", torch.__version__, "sglang", sglang.__version__, "sgl_kernel", sgl_kernel.__version__, "plugin from", engine_ext.__file__)' \
  || { echo "FAIL: the carried packages do not import"; exit 1; }
timeout $((BUDGET + 120)) python3 tests/engine/gpu/servers.py --out "$OUT" --budget-s "$BUDGET"
rc=$?
echo "driver exit $rc after $(( $(date +%s) - t0 )) s"
exit $rc
