#!/usr/bin/env bash
# Build the folder run_checks.sh takes (WHEELS/whl and WHEELS/sglang.tar.gz) for a CPython 3.12 x86-64 GPU
# machine without network. Runs here, where PyPI is reachable; ~35 MB, under the device tool's 64 MiB carry.
#
#   tests/engine/gpu/make_wheels.sh .gpu     # then carry .gpu (ignored by git through .git/info/exclude)
set -euo pipefail
WHEELS=${1:?output folder}
HERE="$(cd "$(dirname "$0")" && pwd)"
PLATFORMS=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" "$@"
}
mkdir -p "$WHEELS/whl"
download -r "$HERE/requirements-cp312.txt" -d "$WHEELS/whl"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download sglang==0.5.23 -d "$tmp"
(cd "$tmp" && python3 -m zipfile -e sglang-*.whl unpacked)
find "$tmp/unpacked/sglang" -name '*.so' -delete  # Rust extensions: the capture path never loads them (~45 MB)
tar -czf "$WHEELS/sglang.tar.gz" -C "$tmp/unpacked" .
du -sh "$WHEELS"
