#!/usr/bin/env bash
# Build what a GPU machine without network needs, here where PyPI is reachable. Two kinds of folder:
#
#   tests/engine/gpu/make_wheels.sh .gpu               # the CUDA checks (run_checks.sh): SGLang 0.5.23's Python
#                                                      # package and its pure dependencies, cp312 (~35 MB)
#   tests/engine/gpu/make_wheels.sh .gpu-0.5.12 0.5.12 # a real SGLang server (run_servers.sh): one site-packages
#   tests/engine/gpu/make_wheels.sh .gpu-0.5.16 0.5.16 # tarball per version, with its own sgl_kernel (sm90 only);
#                                                      # also 0.5.12.post1 and 0.5.15.post1
#
# Each folder is carried to the device by itself (ignored by git through .git/info/exclude); the device tool takes
# 64 MiB per call, tracked files included, which the server kind checks and prints.
set -euo pipefail
WHEELS=${1:?output folder}
VERSION=${2:-}
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
PLATFORMS=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
CP312=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
download() {
  python3 -m pip download -q --no-deps "${CP312[@]}" "$@"
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ -z "$VERSION" ]; then
  mkdir -p "$WHEELS/whl"
  download -r "$HERE/requirements-cp312.txt" -d "$WHEELS/whl"
  download sglang==0.5.23 -d "$tmp"
  (cd "$tmp" && python3 -m zipfile -e sglang-*.whl unpacked)
  find "$tmp/unpacked/sglang" -name '*.so' -delete  # Rust extensions: the capture path never loads them (~45 MB)
  tar -czf "$WHEELS/sglang.tar.gz" -C "$tmp/unpacked" .
  du -sh "$WHEELS"
  exit 0
fi

# A server: SGLang VERSION and what the lent image (Python 3.12, torch 2.11.0+cu130) lacks to serve with it.
case "$VERSION" in
  0.5.12 | 0.5.12.post1) KERNEL=0.4.2.post2 FLASHINFER=0.6.11.post1 TRANSFORMERS=5.6.0 ;;  # NeMo-RL's pin: .post1
  0.5.15.post1) KERNEL=0.4.4 FLASHINFER=0.6.12 TRANSFORMERS=5.12.1 ;;  # slime's image
  0.5.16) KERNEL=0.4.5 FLASHINFER=0.6.14 TRANSFORMERS=5.12.1 ;;
  *) echo "no server recipe for SGLang $VERSION: 0.5.12(.post1), 0.5.15.post1 and 0.5.16 (each its own METADATA's pins) pin the image's torch 2.11.0" >&2; exit 2 ;;
esac
site="$tmp/site"
mkdir -p "$tmp/whl" "$site"
# 0.5.23's import-time list less zstandard, which no server start imports; IPython and soundfile stay (IPython with its
# own dependencies (the image has pygments, psutil, typing-extensions): `import sglang` runs sglang/utils.py, whose
# `from IPython.display import ...` is unguarded (seen on the H100: 0.5.12 did not import without it). Then the
# version's own pins (its transformers: the image's 5.17.0 is not what it was released with, and
# transformers checks tokenizers<=0.23.0 at import), FlashInfer's pure-Python package (the model runner imports
# it unguarded) and jsonschema with its three dependencies (the OpenAI-compatible serving code imports it), at
# the versions .venv runs.
grep -v -E '^(#|zstandard)' "$HERE/requirements-cp312.txt" | grep . > "$tmp/req.txt"
download -r "$tmp/req.txt" -d "$tmp/whl"
download "transformers==$TRANSFORMERS" tokenizers==0.22.2 "flashinfer_python==$FLASHINFER" \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  asttokens==3.0.2 executing==2.3.0 ipython_pygments_lexers==1.1.1 jedi==0.20.1 matplotlib_inline==0.2.2 \
  parso==0.8.7 pexpect==4.9.0 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 stack_data==0.6.3 \
  wcwidth==0.9.4 -d "$tmp/whl"
python3 -m pip wheel -q --no-deps "$REPO" -w "$tmp/whl"  # r3-sidecar: only its dist-info stays (entry points)
python3 -m pip install -q --no-deps --no-compile "${CP312[@]}" --target "$site" "$tmp"/whl/*.whl
rm -rf "$site/engine_ext" "$site/service" "$site/bin"  # the carried tree's plugin runs, never a copy of it
download "sglang==$VERSION" -d "$tmp"
python3 -m zipfile -e "$tmp"/sglang-"$VERSION"-*.whl "$site"
find "$site/sglang" -name '*.so' -delete  # cp311 Rust extensions: a server on this path loads none of them
# sglang-kernel: a cu13 build against torch 2.11.0 (322 MB). sgl_kernel/__init__.py loads <arch>/common_ops
# eagerly; sm90 (Hopper) is the lent cards' arch. flash_ops (1 GB), flashmla_ops and sm100 stay behind:
# triton attention and pytorch sampling reach none of them.
download "sglang-kernel==$KERNEL" -d "$tmp"
(cd "$site" && python3 - "$tmp"/sglang_kernel-*.whl <<'PY'
import sys, zipfile
keep = lambda n: (n.startswith("sglang_kernel-") and ".dist-info/" in n) or (
    n.startswith("sgl_kernel/") and (n.endswith(".py") or n == "sgl_kernel/sm90/common_ops.abi3.so"))
with zipfile.ZipFile(sys.argv[1]) as whl:
    names = [n for n in whl.namelist() if keep(n)]
    whl.extractall(".", names)
assert "sgl_kernel/sm90/common_ops.abi3.so" in names, "no sm90/common_ops in the sglang-kernel wheel"
print(f"sgl_kernel: {len(names)} files kept")
PY
)
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p "$WHEELS"
# xz, not gzip: 41.4 MiB against 63.1 MB for 0.5.15.post1, which gzip left 1.5 MiB over the carry (2026-11-29).
# The device unpacks it with Python's tarfile, which needs no xz binary there.
rm -f "$WHEELS/site.tar.gz"
tar -cf - -C "$site" . | xz -6 -T0 > "$WHEELS/site.tar.xz"
echo "$VERSION" > "$WHEELS/VERSION"
carry=$(du -sb "$WHEELS" | cut -f1)
tree=$(cd "$REPO" && git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
limit=$((64 * 1024 * 1024))
printf 'carry %s: %.1f MiB (site %.1f MiB unpacked); tracked files %.1f MiB; together %.1f of 64 MiB\n' "$WHEELS" \
  "$(echo "$carry / 1048576" | bc -l)" "$(echo "$(du -sb "$site" | cut -f1) / 1048576" | bc -l)" \
  "$(echo "$tree / 1048576" | bc -l)" "$(echo "($carry + $tree) / 1048576" | bc -l)"
if [ $((carry + tree)) -ge "$limit" ]; then
  echo "over the device tool's 64 MiB per call: carry less" >&2
  exit 1
fi
