#!/usr/bin/env bash
# The GPU smoke run (scripts/gpu_smoke.py) on a node with no network: the node's own Python, torch and
# transformers, plus the wheels scripts/gpu_node/wheels.txt lists, carried in $GPU_WHEELS (default .gpu-wheels/,
# filled by scripts/gpu_node/download_wheels.sh where PyPI is reachable). agentrl (built from this tree) and those
# wheels go into a folder of their own ($GPU_SITE, default .gpu-site/) put first on PYTHONPATH: nothing the node
# has is replaced or downloaded. Each phase prints its JSON line as it ends; the whole run stops after
# $SMOKE_TIMEOUT_S seconds (default 480).
# Usage: scripts/gpu_smoke.sh [gpu_smoke.py arguments]     e.g. --phases trainer_memory,weight_sync
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
SITE="${GPU_SITE:-.gpu-site}"
start=$(date +%s)
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
(( ${#wheels[@]} > 0 )) || echo "gpu_smoke: no wheels in $WHEELS (scripts/gpu_node/download_wheels.sh): pydantic must be installed" >&2
rm -rf "$SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check \
  --target "$SITE" . "${wheels[@]}"
echo "gpu_smoke: agentrl and ${#wheels[@]} wheels installed in $SITE in $(( $(date +%s) - start ))s" >&2
export PYTHONPATH="$(cd "$SITE" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=10 "${SMOKE_TIMEOUT_S:-480}" "$PYTHON" scripts/gpu_smoke.py "$@"
