"""The GPU smoke run keeps running where it must run: an offline GPU node with its own packages and no vLLM, Ray,
pydantic (carried), gymnasium, FastAPI...

`scripts/gpu_smoke.sh --cpu` runs every phase of `scripts/gpu_smoke.py` on CPU (fp32, small models) exactly as
the node runs it: agentrl installed from this tree into a folder of its own, and, through tests/gpu_node's import
hook, every agentrl dependency that the node lacks (`scripts/gpu_node/packages.txt`) and that is not carried
(`scripts/gpu_node/wheels.txt`) refused. The Megatron phase runs with the tests' CUDA shim (tests/megatron_cpu).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.megatron_shim import megatron_cpu_env

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "tests" / "gpu_node"
PHASES = ["trainer_memory", "logprob_accuracy", "checkpoint_resume", "weight_sync", "megatron"]


def _node_env(tmp_path: Path) -> dict[str, str]:
    imports = str(tmp_path / "node_imports.txt")
    return megatron_cpu_env(HOOK, AGENTRL_MEGATRON_CPU_SHIM="1", AGENTRL_NODE_IMPORTS=imports)


@pytest.mark.parametrize("module", ["ray", "vllm", "fastapi", "gymnasium", "uvicorn", "wandb"])
def test_the_hook_refuses_what_the_node_lacks(tmp_path, module):
    """The check below would prove nothing if the hook let these through (each is installed here)."""
    code = f"try:\n    import {module}\nexcept ModuleNotFoundError as e:\n    print('refused', e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=_node_env(tmp_path), capture_output=True, text=True)
    assert out.returncode == 0 and "refused" in out.stdout and "not on the GPU node" in out.stdout, out


def test_gpu_smoke_runs_every_phase_with_only_the_gpu_nodes_packages(tmp_path, spawn):
    env = _node_env(tmp_path)
    empty = tmp_path / "wheels"  # the carried wheels are cp312; this venv has the same versions installed
    empty.mkdir()
    site = tmp_path / "site"
    env.update(PYTHON=sys.executable, GPU_WHEELS=str(empty), GPU_SITE=str(site))
    out = tmp_path / "smoke.jsonl"
    cmd = ["bash", "scripts/gpu_smoke.sh", "--cpu", "--out", str(out)]
    proc = spawn(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, _ = proc.communicate(timeout=400)
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    errors = [x for x in lines if "error" in x]
    assert proc.returncode == 0 and not errors, (errors, log[-3000:])
    by = {}
    for x in lines:
        by.setdefault(x["phase"], []).append(x)
    assert by["start"][0]["agentrl"] == str(site / "agentrl"), "agentrl must come from the smoke's own install"
    assert by["end"][0]["ok"] == PHASES

    memory = {x["case"]: x for x in by["trainer_memory"]}
    assert set(memory) == {"pad", "packed", "packed+cpu_offload"}
    for case in memory.values():
        assert len(case["step_s"]) == 2 and case["params"] > 9_000_000 and case["plan_estimate_gib"] > 0
    # the three layouts train the same model on the same batch: the same losses up to float rounding
    assert memory["packed"]["loss"] == pytest.approx(memory["pad"]["loss"], abs=1e-5)
    assert memory["packed+cpu_offload"]["loss"] == pytest.approx(memory["packed"]["loss"], abs=1e-6)

    acc = by["logprob_accuracy"][0]
    assert acc["packed_vs_pad"]["max_abs"] < 1e-4 and acc["packed_vs_pad"]["tokens"] > 100
    assert acc["shared_prompts_vs_plain"]["sharing_ran"] and acc["shared_prompts_vs_plain"]["max_abs"] < 1e-4
    assert acc["vs_fp32"]["max_abs"] == 0.0  # fp32 on CPU: the reference itself

    resume = by["checkpoint_resume"][0]
    assert resume["version_restored"] == 1 and resume["params_bitwise_equal"], resume
    assert resume["loss_resumed"] == resume["loss_straight"]

    sync = {line["case"].removeprefix("bucketed_broadcast_over_gloo_"): line for line in by["weight_sync"]}
    assert all(line["bitwise_equal_to_bf16_export"] for line in sync.values()), sync
    full, first, moved = sync["full"], sync["delta_first"], sync["delta_rows_moved"]
    assert full["tensors"] > 10 and full["buckets"] >= 2 and full["bytes_sent"] > full["buckets_bytes"]
    assert first["bytes_sent"] >= full["bytes_sent"]  # the group's first delta sync: whole buckets
    assert 0 < 2 * moved["elements_moved"] < moved["bytes_sent"] < full["bytes_sent"] / 20  # the moved rows only

    mega = by["megatron"][0]
    assert mega["layers"] == "megatron_local" and mega["grad_norm"][0] > 0
    assert mega["vs_fsdp2"]["max_abs"] < 1e-4, mega  # fp32: the same model, the same numbers
