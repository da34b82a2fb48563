"""`agentrl train examples/sokoban_megatron.yaml` (trainer.backend megatron, tensor parallel 2) end to end on CPU:
warm start, RL steps whose weights reach the vLLM engine through the collective sync, a checkpoint, a resume,
and `agentrl export` of the Megatron checkpoint.

Megatron-Core hard-codes CUDA calls; the test-only shim in tests/megatron_cpu maps them to the CPU inside the
trainer ranks (Ray actors inherit PYTHONPATH; the shim installs only where Megatron is imported). Without it, a
CPU run is refused before Ray starts, which the last test checks.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.observe.metrics import read_jsonl
from tests.cli_run import ROOT, agentrl, assert_one_line_error
from tests.megatron_shim import megatron_cpu_env

EXAMPLE = ROOT / "examples" / "sokoban_megatron.yaml"
TINY = ["envs.train.sokoban.group_size=4", "envs.train.sokoban.groups_per_batch=2", "envs.train.sokoban.max_turns=4",
        "envs.val.sokoban.max_turns=4", "trainer.sft.episodes=16", "trainer.sft.steps=2", "trainer.sft.batch_size=16",
        "trainer.micro_batch_tokens=4096", "validation.every_steps=2", "validation.episodes_per_tag=4",
        "checkpoint.every_steps=1", "logging.tensorboard=false", "logging.console=false",
        # decoupled PPO computes the trainer's log-probs of the batch (train/rollout_logprob_diff); per-turn
        # returns-to-go differ within an episode, so the advantages of an untrained model's (all failing) groups,
        # and its gradients, are not all zero
        "trainer.algorithm.loss=decoupled_ppo", "trainer.algorithm.advantage=turn_return",
        # on-policy: every step's samples come from the weights it trains, so every step checks the last sync
        "async.max_staleness=0", "async.partial_rollout=false"]  # fmt: skip


ENV = megatron_cpu_env(ROOT, AGENTRL_MEGATRON_CPU_SHIM="1")


def _train(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "agentrl", "train", str(EXAMPLE), *TINY, f"trainer.total_steps={steps}",
            f"logging.run_dir={run_dir}", *extra]  # fmt: skip
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_megatron_tp2_trains_syncs_resumes_and_exports(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    first = _train(run_dir, 2)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = _train(run_dir, 3, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from step 2" in resumed.stdout + resumed.stderr

    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in steps)
    warm = next(r for r in rows if "sft/loss" in r)
    assert math.isfinite(warm["sft/loss"])
    # The engine's log-probs of its own samples equal the trainer's (TP2 Megatron vs vLLM's HF-layout weights)
    # only if every sync, including the first after the resume, delivered the Megatron weights whole (measured
    # ~2e-7; a wrong or missing sync is ~1e-2 and more).
    diffs = [r.get("train/rollout_logprob_diff") for r in steps]
    assert all(d is not None and d < 1e-4 for d in diffs), diffs

    out = tmp_path / "hf"
    exported = agentrl("export", str(run_dir), str(out))
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert trained.keys() == base.keys() and all(trained[k].shape == base[k].shape for k in base)
    moved = [k for k in base if not torch.equal(trained[k], base[k])]
    assert len(moved) > len(base) // 2, f"training moved only {moved}"


@pytest.mark.heavy
def test_megatron_on_cpu_without_the_test_shim_is_refused_in_one_line(tmp_path):
    res = agentrl("train", str(EXAMPLE), f"logging.run_dir={tmp_path / 'run'}",
                  env={"AGENTRL_MEGATRON_CPU_SHIM": None, "AGENTRL_PLATFORM": "cpu"})  # fmt: skip
    assert_one_line_error(res, "trainer.backend=megatron", "fsdp2")
    assert not (tmp_path / "run").exists()


def test_parallel_sizes_the_rank_count_cannot_hold_fail_in_one_line(tmp_path):
    res = agentrl("train", str(EXAMPLE), "trainer.num_ranks=3", f"logging.run_dir={tmp_path / 'run'}")
    assert_one_line_error(res, "trainer.num_ranks=3", "tensor_parallel x pipeline_parallel x context_parallel")
    res = agentrl("train", str(EXAMPLE), "trainer.num_ranks=4", "trainer.megatron.expert_parallel=4",
                  f"logging.run_dir={tmp_path / 'run'}")  # fmt: skip
    assert_one_line_error(res, "expert_parallel=4", "data_parallel x context_parallel")
    res = agentrl("train", str(EXAMPLE), "trainer.megatron.context_parallel=2", "trainer.megatron.tensor_parallel=1",
                  f"logging.run_dir={tmp_path / 'run'}")  # fmt: skip
    assert_one_line_error(res, "context_parallel > 1 is not supported yet")
    assert not (tmp_path / "run").exists()
