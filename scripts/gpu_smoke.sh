#!/usr/bin/env bash
# GPU smoke test on one CUDA device, under 8 minutes on an H200 with internet access to PyPI only:
#   1. a virtualenv of its own (.venv-gpu) with agentrl[cuda] exactly as users install it: pinned by
#      constraints-cuda.txt (vLLM and the CUDA torch that release pins, from PyPI) and the megatron extra,
#   2. scripts/gpu_smoke.py: 2 bf16 trainer steps of a random ~0.5B Qwen3 with activation checkpointing, the
#      vLLM engine on the tiny model through a disk and a collective weight update, and 2 steps of the same model
#      on the Megatron-Core backend; prints one JSON line (tokens/s, peak memory, engine vs trainer and Megatron vs
#      FSDP2 log-prob agreement).
# Usage: scripts/gpu_smoke.sh [--out FILE]     (extra arguments go to gpu_smoke.py)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-gpu}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="$(sed -n 's/^vllm==//p' constraints-cuda.txt)"
start=$(date +%s)
if [[ ! -x "$VENV/bin/agentrl" ]]; then
  "$PYTHON" -m venv "$VENV"
  timeout 300 "$VENV/bin/pip" install -q --upgrade "pip>=24"
  timeout 300 "$VENV/bin/pip" install -q -c constraints-cuda.txt -e ".[cuda,megatron]"
fi
echo "gpu_smoke: $VENV ready in $(( $(date +%s) - start ))s (vllm ${VLLM_VERSION})" >&2
left=$(( 480 - ($(date +%s) - start) ))
(( left > 60 )) || left=60
exec timeout --kill-after=10 "$left" "$VENV/bin/python" scripts/gpu_smoke.py "$@"
