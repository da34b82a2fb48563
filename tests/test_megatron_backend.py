"""The Megatron-Core backend on CPU, against the plain HF model: weights round trip, log-probs and entropies,
one AdamW step, the critic (values, one step), checkpoint resume and offline HF export, at TP1 x DP2, TP2 and
PP2 (Megatron's 1F1B pipeline schedule over gloo).

Every check runs in torchrun processes of its own (tests/megatron_cpu/check_backend.py), with the test-only CUDA
-> CPU shim installed there by tests/megatron_cpu/sitecustomize.py; the pytest process never imports Megatron.
One launch per layout measures everything and writes JSON; the tests below assert on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.megatron_shim import SHIM_DIR, megatron_cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES = {  # name: (processes, tensor parallel, extra flags); TP1 and TP2 cover both optimizers
    "tp1_dp2": (2, 1, ["--recompute"]),  # two data-parallel replicas, distributed optimizer, recomputation
    "tp2": (2, 2, ["--no-distributed-optimizer"]),
    "pp2": (2, 1, ["--pp", "2"]),  # two pipeline stages: the 1F1B schedule, tied embeddings on both ends
}
SCHEDULES = {1: "forward_backward_no_pipelining", 2: "forward_backward_pipelining_without_interleaving"}
TOL = 1e-5


def _env() -> dict[str, str]:
    return megatron_cpu_env(ROOT, AGENTRL_PLATFORM="cpu", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def launches(tmp_path_factory, tiny_model_path) -> dict[str, dict | str]:
    """Every launch started at once (each is mostly process start-up and imports), then collected: name ->
    the measurements, or the output tail of a failed launch."""
    procs = {}
    for name, (nproc, tp, flags) in LAUNCHES.items():
        work = tmp_path_factory.mktemp(f"megatron_{name}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        cmd += [os.path.join(SHIM_DIR, "check_backend.py"), "--tp", str(tp), "--work", str(work)]
        cmd += ["--out", str(work / "result.json"), *flags]
        log = open(work / "log.txt", "w")  # noqa: SIM115  (closed below)
        procs[name] = (subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), work, log)
    results: dict[str, dict | str] = {}
    for name, (proc, work, log) in procs.items():
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        out = work / "result.json"
        if rc == 0 and out.exists():
            results[name] = {**json.loads(out.read_text()), "launch": name}
        else:
            results[name] = f"exit {rc}:\n" + (work / "log.txt").read_text()[-8000:]
    return results


@pytest.fixture(params=list(LAUNCHES))
def run(request, launches) -> dict:
    result = launches[request.param]
    assert isinstance(result, dict), result
    return result


@pytest.mark.slow
def test_layout(run):
    nproc, tp, _ = LAUNCHES[run["launch"]]
    assert (run["world"], run["tp"]) == (nproc, tp)
    assert run["dp_size"] == nproc // (tp * run["pp"]) and run["dp_rank"] == 0
    assert run["dp_group_size"] == run["dp_size"]
    assert run["schedule"] == SCHEDULES[run["pp"]]


def test_hf_megatron_hf_roundtrip_bitexact(run):
    assert run["roundtrip_missing"] == [] and run["roundtrip_extra"] == []
    assert run["roundtrip_names_equal"], "full_weights order differs from weight_metas"
    assert run["roundtrip_meta_shapes_equal"], "weight_metas shapes/dtypes differ from full_weights"
    assert run["roundtrip_bitexact"]


@pytest.mark.parametrize("layout", ["pad", "pad_full", "packed", "packed_full", "packed_nomask"])
@pytest.mark.parametrize("model", ["ref", "policy"])
def test_logprobs_and_entropy_match_hf(run, layout, model):
    assert run[f"logprob_diff_{layout}_{model}"] < TOL
    assert run[f"entropy_diff_{layout}_{model}"] < TOL
    assert run["logprob_zero_outside_loss"]
    assert run["logprob_without_entropy_equal"]


@pytest.mark.parametrize("key", ["temperature", "truncated"])
def test_logprobs_and_entropy_of_the_sampling_distribution_match_hf(run, key):
    assert run[f"sampling_logprob_diff_{key}"] < TOL
    assert run[f"sampling_entropy_diff_{key}"] < TOL


def test_several_micro_batches_of_different_shapes_in_one_schedule(run):
    assert run["several_microbatches_diff"] < TOL


def test_one_step_matches_torch_adamw(run):
    megatron_norm, torch_norm = run["step_grad_norm"]
    assert abs(megatron_norm - torch_norm) < 1e-5 * torch_norm
    assert run["step_weight_change"] > 1e-4, "the step did not move the weights"
    assert run["step_weight_diff"] < 1e-6


@pytest.mark.parametrize("layout", ["pad", "packed"])
def test_critic_values_match_hf_value_model(run, layout):
    assert run[f"value_diff_{layout}"] < TOL


def test_critic_step_matches_torch_adamw(run):
    megatron_norm, torch_norm = run["critic_grad_norm"]
    assert abs(megatron_norm - torch_norm) < 1e-5 * torch_norm
    assert run["critic_head_diff"] < 1e-6
    assert run["critic_value_diff_after_step"] < TOL


def test_checkpoint_resume(run):
    assert run["ckpt_extra_ok"] and run["ckpt_steps"] == 1
    assert run["ckpt_load_diff"] == 0.0
    first, resumed = run["ckpt_step_grad_norm"]
    assert first == resumed
    assert run["ckpt_step_diff"] == 0.0
    assert run["ckpt_critic_value_diff"] == 0.0 and run["ckpt_critic_steps"] == 1


def test_offline_export_to_hf(run):
    assert run["export_names_equal"] and run["export_bitexact"]


def test_activation_recompute_configured(run):
    assert run["recompute"] == ("full" if "--recompute" in LAUNCHES[run["launch"]][2] else None)


@pytest.mark.heavy
def test_shim_installs_only_with_megatron():
    code = (
        "import torch; before = torch.cuda.current_device.__module__;"
        "import megatron.core; after = torch.cuda.current_device();"
        "print(before, after)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = proc.stdout.split()[-2:]
    assert before == "torch.cuda" and after == "cpu"
