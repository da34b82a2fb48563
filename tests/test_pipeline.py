"""The whole pipeline end to end (real Ray, vLLM-CPU, FSDP2 trainer, env managers; the train env on an OpenEnv
server), 3 steps: synchronous (weight updates wait for in-flight generations; it saves the warm start) and fully
async with partial rollout and reward functions (it reuses that warm start). The loop's logic in every mode
(one-step-off too) is test_run_loop.py's, on stand-ins in seconds; turn-wise samples run end to end in
test_trainer_exact_real_batches.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.observe.metrics import read_jsonl
from agentrl.run.loop import Pipeline
from agentrl.run.parts import start_parts
from agentrl.run.warm_start import is_cached, warm_start_cache
from agentrl.run.weights import weights_dir
from tests.servers import free_port, wait_until_healthy

CONFIG = Path(__file__).parent / "configs" / "tiny_pipeline.yaml"
MODES = {
    "sync": ["async.max_staleness=0", "async.partial_rollout=false"],
    # + async reward functions scored by the reward workers: return = env return + 0.5 x answer format + 0.25 x
    # tool-call format (1 when an episode makes no call, as here)
    "async_partial": ["async.max_staleness=2", "async.partial_rollout=true",
                      "reward.functions=[{name: answer_format, weight: 0.5}, {name: tool_call_format, weight: 0.25}]"],
}  # fmt: skip


@pytest.fixture(scope="module")
def warm_cache_dir(tmp_path_factory) -> Path:
    """One trainer.sft.cache folder for the modes: the first run saves its warm start, the second (the same model,
    envs and SFT settings; it differs in async.* and reward.*) reuses it."""
    return tmp_path_factory.mktemp("warm_cache")


@pytest.fixture(scope="module")
def served_sokoban():
    """`agentrl serve-envs` in its own process: the runs train on Sokoban over the OpenEnv protocol."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve-envs", "agentrl/SimpleSokoban-v0", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_healthy(proc, f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.slow
async def test_every_mode_trains_within_the_staleness_bound(
    mode, ray_session, tmp_path, tiny_model_path, warm_cache_dir, served_sokoban
):
    cache_args = [f"model.path={tiny_model_path}", "trainer.sft.cache=true", f"model.cache_dir={warm_cache_dir}"]
    # the train env (and the warm start's expert) on an OpenEnv server, validation in process
    cache_args += [
        "envs.train.sokoban.env_id=agentrl/OpenEnv-v0",
        f"envs.train.sokoban.kwargs={{url: '{served_sokoban}'}}",
    ]
    cfg = load_config(CONFIG, [*MODES[mode], f"name={mode}", "checkpoint.every_steps=0", *cache_args])
    cache = warm_start_cache(cfg, tiny_model_path)
    reused = is_cached(cache)
    parts = start_parts(cfg, tmp_path)
    pipeline = Pipeline(cfg, tmp_path, parts)
    trained, first_step_beside_validation = [], []
    original = pipeline.trainer.train_step
    loop, third_step = asyncio.get_running_loop(), asyncio.Event()

    def spy(samples, report):
        trained.append((pipeline.state.step, samples))  # the policy version = trained batches
        if pipeline.state.step == 0:  # the step-0 validation was started beside the first batch, not awaited
            first_step_beside_validation.append(pipeline.validation.task is not None)
        if pipeline.state.step == 2:
            loop.call_soon_threadsafe(third_step.set)
        return original(samples, report)

    pipeline.trainer.train_step = spy
    synced_during_validation = []
    sync = pipeline.weights.sync

    async def sync_spy(version):  # validation (every 2 steps) runs beside the next step, on the weights it measures
        synced_during_validation.append(pipeline.validation.running)
        await sync(version)

    pipeline.weights.sync = sync_spy
    validate = pipeline.validate

    async def held_validation(step):  # step 2's validation ends only once step 3 trains beside it (or times out)
        if step == 2:
            await asyncio.wait_for(third_step.wait(), 120)
        return await validate(step)

    pipeline.validate = held_validation
    try:
        result = await pipeline.run(resume_from=None)
    finally:
        pipeline.close()
        parts.close()
    assert len(trained) == 3
    k = cfg.async_.max_staleness
    for version, samples in trained:
        assert samples and all(version - min(s.policy_versions) <= k for s in samples)
    logged = list(read_jsonl(tmp_path / "metrics.jsonl"))
    rows = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert synced_during_validation and not any(synced_during_validation)
    assert first_step_beside_validation == [True]
    order = [("val" if "val/success" in r else "train", r["step"]) for r in logged if "sft/seconds" not in r]
    assert [x for x in order if x[0] == "val"] == [("val", 0), ("val", 2), ("val", 3)]
    assert order.index(("val", 2)) < order.index(("train", 3)), "a validation is logged before the next step"
    for key in ("idle/trainer", "idle/rollout", "staleness/max", "throughput/tokens_per_s", "episode/success"):
        assert key in rows[0], key
    assert max(r["staleness/max"] for r in rows) <= k
    assert "val/success" in result["first"] and "val/success" in result["last"]
    warm = next(r for r in read_jsonl(tmp_path / "metrics.jsonl") if "sft/seconds" in r)
    assert bool(warm.get("sft/cached")) == reused, "a cached warm start is reused, and only then"
    assert is_cached(cache) and not list(warm_cache_dir.glob("*.tmp-*")), "the warm start was saved, no leftovers"
    assert ("sft/loss" in warm) != reused  # a reused warm start runs no SFT step
    # Two-version samples depend on timing here; test_envmanager_vllm.py checks them deterministically.
    assert all(r["rollout/failed_episodes"] == 0 for r in rows), "every episode on the served env finished"
    if mode == "sync":
        assert all(len(s.policy_versions) == 1 for _, samples in trained for s in samples)
    if cfg.reward.functions:  # the reward pool scored every trained episode: its weighted bonus is on top
        bonuses = []
        for r in rows:  # means over the step's episodes, so the weighted sum holds for them too
            bonuses.append(r["episode/return"] - r["env/sokoban/env_return"])
            scores = r["reward/answer_format"], r["reward/tool_call_format"]
            assert all(0.0 <= x <= 1.0 for x in scores) and r["rollout/missing_rewards"] == 0
            assert bonuses[-1] == pytest.approx(0.5 * scores[0] + 0.25 * scores[1])
        assert max(bonuses) > 0.0
    groups = [
        g for line in (tmp_path / "trained_groups.jsonl").read_text().splitlines() for g in json.loads(line)["groups"]
    ]
    assert len(groups) == len(set(groups)) == 3 * 2


def test_the_warm_start_cache_key_leaves_out_rl_only_settings(tiny_model_path):
    """Runs that differ in their seed or RL learning rate share a warm start; the SFT's own settings and the
    optimizer settings it uses make a new one."""
    base = ["trainer.sft.cache=true"]

    def key(*extra: str):
        return warm_start_cache(load_config(CONFIG, [*base, *extra]), tiny_model_path)

    assert key() == key("seed=7") == key("trainer.optim.lr=0.002", "trainer.total_steps=99")
    assert key() == key("trainer.optim.schedule=linear", "trainer.optim.warmup_steps=5")
    assert key() != key("trainer.sft.lr=0.01") and key() != key("trainer.optim.betas=[0.9,0.95]")
    # how RL groups episodes does not shape a demo; the env's own settings do
    grouping = ("envs.train.sokoban.group_size=8", "envs.train.sokoban.groups_per_batch=5")
    assert key() == key(*grouping) == key("envs.train.sokoban.self_play=true")
    assert key() != key("envs.train.sokoban.max_turns=6") != key("envs.train.sokoban.kwargs={mark_revisits: true}")
    # LoRA's full warm start is full fine-tuning's (the adapters start on its result); an adapters-only one is not
    assert key() == key("trainer.lora.rank=8") == key("trainer.lora.rank=16")
    adapters = "trainer.lora.warm_start=adapters"
    assert key() != key("trainer.lora.rank=8", adapters) != key("trainer.lora.rank=16", adapters)


def test_weights_dir_is_per_driver_and_dead_drivers_folders_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    left = tmp_path / f"agentrl-weights-same-{host}-{int(dead.stdout)}"  # left behind by a kill -9
    live = tmp_path / f"agentrl-weights-same-{host}-{os.getppid()}"  # another run of the same name, still running
    elsewhere = tmp_path / f"agentrl-weights-same-otherhost-{int(dead.stdout)}"  # a pid of another node: not ours
    for d in (left, live, elsewhere):
        (d / "v3").mkdir(parents=True, exist_ok=True)
    try:
        mine = weights_dir(str(tmp_path), "same")
        assert mine.name == f"agentrl-weights-same-{host}-{os.getpid()}" and mine not in (left, live)
        assert not left.exists() and live.exists() and elsewhere.exists()
        default = weights_dir(None, "same")  # one node: shared memory
        assert default.parent == (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp"))
    finally:
        for d in (left, live, elsewhere):
            shutil.rmtree(d, ignore_errors=True)
