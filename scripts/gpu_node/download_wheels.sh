#!/usr/bin/env bash
# Downloads the wheels scripts/gpu_node/wheels.txt lists (CPython 3.12, manylinux x86_64, no dependencies: the list
# is complete beside the node's own packages.txt) into $GPU_WHEELS (default .gpu-wheels/, git-ignored) for the
# offline GPU node, and fails if they pass 64 MiB, the most that can be carried there. Run where PyPI is reachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${GPU_WHEELS:-.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
LIMIT_MIB=64
mkdir -p "$OUT"
"$PYTHON" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -r scripts/gpu_node/wheels.txt -d "$OUT"
bytes=$(cat "$OUT"/*.whl | wc -c)
echo "gpu wheels: $(ls "$OUT"/*.whl | wc -l) in $OUT, $(( bytes / 1024 )) KiB (limit ${LIMIT_MIB} MiB)"
(( bytes <= LIMIT_MIB * 1024 * 1024 )) || { echo "gpu wheels: over ${LIMIT_MIB} MiB" >&2; exit 1; }
