"""The RL loop's logic in seconds: `Pipeline` driving stand-ins for its parts (no Ray, no vLLM, no trainer ranks)
through every mode, a stop signal and its resume, and both kinds of stall. The stand-ins keep the rules the real
parts keep: engines stamp each generated token with the version of the weights they hold; without partial
rollout a weight update waits for the generations in flight; a trainer step makes the next version. The real parts
run the same loop end to end in test_pipeline.py, test_pipeline_resume.py and test_pipeline_faults.py."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.observe.metrics import read_jsonl
from agentrl.run.buffer import RolloutStalled
from agentrl.run.loop import Pipeline
from agentrl.run.parts import RunParts
from agentrl.run.state import latest_checkpoint
from agentrl.types import EpisodeFailure, Group, Sample

CONFIG = Path(__file__).parent / "configs" / "tiny_pipeline.yaml"
STEPS = 6


class Remote:
    """A Ray actor method's stand-in: `.remote(...)` starts the call and returns an awaitable, as Ray does."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args, **kwargs) -> asyncio.Future:
        return asyncio.ensure_future(self.fn(*args, **kwargs))


class StandInEngines:
    """The rollout engines' stand-in (no vLLM): the version of the weights they hold, the generations in flight,
    and what each validation episode was generated with."""

    def __init__(self) -> None:
        self.version = 0
        self.in_flight = 0
        self.validated_on: dict[int, set[int]] = {}  # validation seed -> versions its tokens came from

    async def generate(self, seconds: float) -> list[int]:
        """Two tokens; the version each was generated on (an update mid-generation preempts and resumes it)."""
        self.in_flight += 1
        try:
            first = self.version
            await asyncio.sleep(seconds)
            return [first, self.version]
        finally:
            self.in_flight -= 1


class StandInWeights:
    """Weight sync's stand-in: without partial rollout an update waits until no generation is in flight."""

    def __init__(self, engines: StandInEngines, partial: bool) -> None:
        self.engines, self.partial, self.synced = engines, partial, []

    async def sync(self, version: int) -> None:
        while not self.partial and self.engines.in_flight:
            await asyncio.sleep(0.001)
        self.engines.version = version
        self.synced.append(version)

    def close(self) -> None:
        pass


class StandInTrainer:
    """The trainer's stand-in: each step makes the next policy version; a checkpoint holds the version."""

    def __init__(self, loop: asyncio.AbstractEventLoop, step_s: float = 0.02) -> None:
        self.version, self.batches, self.step_s, self.loop = 0, [], step_s, loop
        self.during_step = lambda version: None  # a test's hook, on the event loop, while step `version` trains

    def train_step(self, samples: list[Sample], report: list[int]) -> dict[str, Any]:
        self.batches.append((self.version, samples))
        self.reported = list(report)
        self.loop.call_soon_threadsafe(self.during_step, self.version + 1)
        time.sleep(self.step_s)
        self.version += 1
        return {"train/loss": 0.5, "train/grad_norm": 1.0}

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "version.json").write_text(json.dumps(self.version))

    def load_checkpoint(self, path: str) -> None:
        self.version = json.loads((Path(path) / "version.json").read_text())

    def shutdown(self) -> None:
        pass


class StandInManager:
    """An env manager's stand-in: a group's episodes, each two generations long, with returns that vary."""

    def __init__(self, engines: StandInEngines, group_size: int, fail: bool = False) -> None:
        self.engines, self.group_size, self.fail = engines, group_size, fail
        self.rng = random.Random(0)
        self.run_group = Remote(self._run_group)

    async def _run_group(
        self, tag: str, seed: int, split: str = "train", n: int | None = None, self_play: bool = True
    ) -> Group:
        group = Group(tag=tag, seed=seed, split=split)
        for i in range(n or self.group_size):
            episode = f"{tag}/{seed}/{split}/{i}"
            if self.fail:
                await asyncio.sleep(0.001)
                group.failures.append(EpisodeFailure(episode, "ValueError: the env broke"))
                continue
            slow = 0.03 if split == "val" else self.rng.uniform(0.001, 0.01)  # validation outlasts a train step
            versions = await self.engines.generate(slow) + await self.engines.generate(slow)
            if split == "val":
                self.engines.validated_on[seed] = set(versions)
            reward = float((seed + i) % 2)
            group.samples.append(Sample([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0.0] * 5, [-1, *versions], reward,
                                        f"{tag}/{seed}", episode))  # fmt: skip
            group.episode_metrics.append({"return": reward, "success": reward, "turns": 2.0, "length": 4.0})
        return group


class StandInRouter:
    def __init__(self, no_live_s: float = 0.0) -> None:
        status = {"events": [], "awaiting_weights": False, "restarting": 0, "live": 1, "deaths": 0, "restarts": 0}
        self.status = {**status, "no_live_s": no_live_s}
        self.fleet_status = Remote(self._status)

    async def _status(self) -> dict:
        return self.status


def _pipeline(run_dir: Path, *overrides: str, fail: bool = False, no_live_s: float = 0.0) -> Pipeline:
    cfg = load_config(CONFIG, ["trainer.sft.enabled=false", f"trainer.total_steps={STEPS}", *overrides])
    engines = StandInEngines()
    trainer = StandInTrainer(asyncio.get_running_loop())
    weights = StandInWeights(engines, cfg.async_.partial_rollout)
    managers = [StandInManager(engines, cfg.envs.train["sokoban"].group_size, fail) for _ in range(2)]
    pipeline = Pipeline(cfg, run_dir, RunParts(trainer, weights, StandInRouter(no_live_s), managers))
    pipeline.engines = engines  # for the asserts
    return pipeline


def _trained_groups(run_dir: Path) -> list[str]:
    lines = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    return [g for line in lines for g in json.loads(line)["groups"]]


MODES = {  # name: (max_staleness, partial rollout)
    "sync": (0, False),
    "one_step_off": (1, False),
    "fully_async_partial": (2, True),
}


@pytest.mark.parametrize("mode", list(MODES))
async def test_every_mode_trains_within_the_staleness_bound_and_validates_on_the_weights_of_its_step(mode, tmp_path):
    k, partial = MODES[mode]
    pipeline = _pipeline(tmp_path, f"async.max_staleness={k}", f"async.partial_rollout={str(partial).lower()}",
                         "checkpoint.every_steps=0")  # fmt: skip
    synced_during_validation = []
    sync = pipeline.weights.sync

    async def watched_sync(version: int) -> None:
        synced_during_validation.append(pipeline.validation.running)
        await sync(version)

    pipeline.weights.sync = watched_sync
    seen: dict[int, set[int]] = {}  # validated step -> the versions its episodes' tokens came from
    validate = pipeline.validate

    async def recorded(step: int) -> dict[str, float]:
        pipeline.engines.validated_on.clear()
        out = await validate(step)
        seen[step] = set().union(*pipeline.engines.validated_on.values())
        return out

    pipeline.validate = recorded
    result = await pipeline.run(resume_from=None)
    pipeline.close()

    trainer = pipeline.trainer
    assert [version for version, _ in trainer.batches] == list(range(STEPS))
    stale = [version - min(s.policy_versions) for version, samples in trainer.batches for s in samples]
    assert max(stale) == k, f"the bound is {k} and the rollout (faster than training) runs up to it"
    if k == 0:  # on-policy: every token of every batch comes from the weights being trained
        assert all(s.policy_versions == {v} for v, samples in trainer.batches for s in samples)
    assert not any(synced_during_validation), "a weight sync came while a validation was running"
    # Validation at 0, every 2 steps and at the end, on the weights of the step it measures, though the next step
    # trains beside it (its episodes outlast a train step).
    assert seen == {0: {0}, 2: {2}, 4: {4}, 6: {6}}
    rows = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows if "val/success" in r] == [0, 2, 4, 6]
    assert result["first"]["val/success"] == rows[0]["val/success"] and "val/success" in result["last"]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["train/version"] == r["step"] and r["staleness/max"] <= k for r in trained)
    for key in ("timing/rollout", "timing/train", "timing/weight_sync", "idle/trainer", "rollout/live_engines"):
        assert key in trained[0], key
    groups = _trained_groups(tmp_path)
    assert len(groups) == len(set(groups)) == STEPS * 2


async def test_a_stop_signal_saves_the_step_and_the_resume_trains_every_admitted_group_once(tmp_path):
    pipeline = _pipeline(tmp_path, "async.max_staleness=2", "async.partial_rollout=true", "checkpoint.every_steps=0")

    def stop_during(version: int) -> None:
        if version == 3:
            pipeline.signals.stop(signal.SIGTERM)

    pipeline.trainer.during_step = stop_during
    await pipeline.run(resume_from=None)
    pipeline.close()
    assert pipeline.stop_signal == signal.SIGTERM and pipeline.state.step == 3, "the step under way finishes"
    assert latest_checkpoint(tmp_path).name == "step-000003"

    resumed = _pipeline(tmp_path, "async.max_staleness=2", "async.partial_rollout=true", "checkpoint.every_steps=0")
    await resumed.run(resume_from=latest_checkpoint(tmp_path))
    resumed.close()
    assert resumed.stop_signal is None and resumed.trainer.version == STEPS
    assert resumed.weights.synced[0] == 3, "the engines get the checkpoint's weights first"
    trained = _trained_groups(tmp_path)
    left = resumed.buffer.state()  # what the run admitted and did not train: running or ready at its end
    pending = [f"{t}/{s}" for t, s in left["running"]] + [f"{g.tag}/{g.seed}" for g in left["ready"]]
    admitted = ["/".join(map(str, resumed.state.schedule.at(i))) for i in range(resumed.state.schedule.cursor)]
    assert len(trained) == len(set(trained)) and sorted(trained + pending) == sorted(admitted)
    rows = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "val/success" in r] == [0, 2, 4, 6]  # step 3 is not due: none to re-run


async def test_a_stop_while_waiting_for_a_batch_takes_no_group(tmp_path):
    pipeline = _pipeline(tmp_path, "async.max_staleness=0", "checkpoint.every_steps=0")
    slow = pipeline.managers[0].run_group.fn

    async def hold(*args, **kwargs):  # train groups never finish: the trainer waits for its first batch
        if len(args) < 3 or args[2] == "train":
            await asyncio.sleep(3600)
        return await slow(*args, **kwargs)

    for manager in pipeline.managers:
        manager.run_group = Remote(hold)
    asyncio.get_running_loop().call_later(0.2, pipeline.signals.stop, signal.SIGINT)
    await asyncio.wait_for(pipeline.run(resume_from=None), 30)
    pipeline.close()
    assert pipeline.stop_signal == signal.SIGINT and pipeline.state.step == 0 and not pipeline.trainer.batches
    assert latest_checkpoint(tmp_path).name == "step-000000"


async def test_every_episode_failing_stalls_the_run_with_the_first_error_and_a_checkpoint(tmp_path):
    pipeline = _pipeline(tmp_path, "rollout.stop_after_failed_groups=3", fail=True)
    first = r"sokoban/\d+/train/0: ValueError: the env broke"
    with pytest.raises(RolloutStalled, match=f"every episode of the last 3 groups failed; the first: {first}"):
        await asyncio.wait_for(pipeline.run(resume_from=None), 30)
    pipeline.close()
    assert latest_checkpoint(tmp_path).name == "step-000000"


async def test_no_healthy_engine_past_its_timeout_stalls_the_run(tmp_path):
    pipeline = _pipeline(tmp_path, "rollout.no_engine_timeout_s=5", no_live_s=6.0)
    for manager in pipeline.managers:  # nothing finishes while no engine lives
        manager.run_group = Remote(lambda *a, **k: asyncio.sleep(3600))
    with pytest.raises(RolloutStalled, match=r"no healthy rollout engine for 6 s \(rollout.no_engine_timeout_s=5\)"):
        await asyncio.wait_for(pipeline.run(resume_from=None), 30)
    pipeline.close()
