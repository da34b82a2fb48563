"""`scripts/gpu_smoke.py --cpu --small`: the GPU smoke script's whole path (random Qwen3 trainer steps, a vLLM
engine through a disk and a collective weight update, engine vs trainer log-probs) runs on CPU, so the script a
GPU machine runs once is not first exercised there. The Megatron phase runs too, with the tests' CUDA shim on
PYTHONPATH (tests/megatron_cpu: it maps Megatron-Core's CUDA calls to the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_smoke_script_runs_on_cpu_and_engine_agrees_with_trainer(tmp_path, spawn):
    out = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    shim = os.pathsep.join([str(ROOT / "tests" / "megatron_cpu"), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(PYTHONPATH=shim.rstrip(os.pathsep), AGENTRL_MEGATRON_CPU_SHIM="1")
    cmd = [sys.executable, "scripts/gpu_smoke.py", "--cpu", "--small", "--megatron", "--out", str(out)]
    proc = spawn(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    result = json.loads(out.read_text())
    trainer, engine = result["trainer"], result["engine"]
    assert trainer["precision"] == "fp32" and len(trainer["step_s"]) == 2 and trainer["tokens_per_s"] > 0
    assert engine["versions_after_update"] == [1] and engine["versions_after_collective_update"] == [2]
    for key in (
        "logprob_agreement_before_update",
        "logprob_agreement_after_update",
        "logprob_agreement_after_collective_update",
    ):
        assert engine[key]["tokens"] > 0 and engine[key]["max_abs_diff"] < 1e-3, engine[key]
    assert engine["trainer_logprob_shift_from_step"] > 1e-3, "the trainer step did not change the weights"
    megatron = result["megatron"]
    assert megatron["layers"] == "megatron_local" and len(megatron["step_s"]) == 2 and megatron["grad_norm"][0] > 0
    assert megatron["logprob_vs_fsdp2"]["max_abs_diff"] < 1e-4, megatron  # fp32: the same model, the same numbers
