"""Reward workers: missing rewards (failure, timeout) are marked and counted, back-pressure, process isolation
with a hard kill, and 500 episodes through 2 Ray workers overlapping a slow reward."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from agentrl.config.schema import RewardConfig, RewardFnSpec
from agentrl.reward import Episode, FnOutput, RewardPool, RewardResult, combine
from agentrl.reward.pool import MissingKind

HERE = "tests.test_reward_pool"
_live = {"now": 0, "max": 0}


def slow_reward(episode: Episode, seconds: float = 0.2) -> float:
    """A sync reward that sleeps (runs in a worker thread)."""
    time.sleep(seconds)
    return 0.5


def failing_reward(episode: Episode) -> float:
    raise RuntimeError("verifier crashed")


async def sometimes_hangs(episode: Episode, every: int = 50) -> FnOutput:
    """Hangs (past its timeout) on every `every`-th episode id."""
    if int(episode.episode_id) % every == 0:
        await asyncio.sleep(3600)
    return FnOutput(1.0, {"checked": 1.0})


async def counting_reward(episode: Episode, seconds: float = 0.05) -> float:
    _live["now"] += 1
    _live["max"] = max(_live["max"], _live["now"])
    await asyncio.sleep(seconds)
    _live["now"] -= 1
    return 1.0


def pid_then_sleep(episode: Episode, pid_file: str, seconds: float = 0.0) -> float:
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return 1.0


def cfg(*specs: dict, **kw: object) -> RewardConfig:
    return RewardConfig(functions=[RewardFnSpec(**s) for s in specs], **kw)


def math_episode(i: int, answer: str | None = None) -> Episode:
    truth = str(i * 3)
    return Episode(final_answer=f"<answer>{answer or truth}</answer>", task={"ground_truth": truth}, episode_id=str(i))


async def test_weighted_sum_components_and_metrics() -> None:
    pool = RewardPool(
        cfg({"name": "math_verify", "weight": 2.0}, {"name": "answer_format", "weight": 0.5},
            {"name": "tool_call_format", "weight": 1.0}),
        local=True,
    )  # fmt: skip
    result = await pool.score(math_episode(4))
    assert result.score == pytest.approx(2.0 + 0.5 + 1.0) and not result.missing
    assert result.components == {"math_verify": 1.0, "answer_format": 1.0, "tool_call_format": 1.0}
    assert result.metrics["reward/tool_call_format/calls"] == 0.0
    wrong = await pool.score(math_episode(4, answer="13"))
    assert wrong.score == pytest.approx(0.5 + 1.0)
    assert pool.stats()["scored"] == 2 and pool.stats()["incomplete"] == 0
    pool.shutdown()


async def test_failure_and_timeout_are_missing_not_zero() -> None:
    pool = RewardPool(
        cfg({"name": "math_verify"}, {"name": f"{HERE}:failing_reward"},
            {"name": f"{HERE}:sometimes_hangs", "kwargs": {"every": 1}, "timeout_s": 0.2}),
        local=True,
    )  # fmt: skip
    result = await asyncio.wait_for(pool.score(math_episode(1)), 5)
    assert result.score is None and result.components == {"math_verify": 1.0}
    assert result.missing[f"{HERE}:failing_reward"] == "error: RuntimeError: verifier crashed"
    assert result.missing[f"{HERE}:sometimes_hangs"] == "timeout after 0.2s"
    assert result.missing[f"{HERE}:sometimes_hangs"].kind is MissingKind.TIMEOUT
    stats = pool.stats()
    assert stats["missing_by_reason"] == {"error": 1, "timeout": 1} and stats["incomplete"] == 1
    pool.shutdown()


async def test_episode_timeout_covers_everything() -> None:
    pool = RewardPool(cfg({"name": f"{HERE}:slow_reward", "kwargs": {"seconds": 2}}, timeout_s=0.2), local=True)
    result = await asyncio.wait_for(pool.score(math_episode(1)), 5)
    assert result.score is None and result.missing[f"{HERE}:slow_reward"].startswith("timeout: episode not scored")
    pool.shutdown()


async def test_bounded_queue_applies_back_pressure() -> None:
    _live.update(now=0, max=0)
    pool = RewardPool(cfg({"name": f"{HERE}:counting_reward"}, queue_size=3), local=True)
    tasks = [asyncio.ensure_future(pool.score(math_episode(i))) for i in range(12)]
    await asyncio.sleep(0.02)
    assert pool.in_queue == 12 and pool.stats()["in_flight"] == 3
    results = await asyncio.gather(*tasks)
    assert all(r.score == 1.0 for r in results) and _live["max"] == 3
    assert pool.stats()["in_queue"] == 0
    pool.shutdown()


def test_combine_rule() -> None:
    reward_cfg = RewardConfig(env_reward_weight=0.5)
    assert combine(2.0, RewardResult(score=1.5), reward_cfg) == pytest.approx(2.5)
    assert combine(2.0, RewardResult(score=None, missing={"f": "timeout after 1s"}), reward_cfg) is None
    assert combine(2.0, None, reward_cfg) == 1.0


def test_config_rejects_duplicate_names_and_unknown_rewards() -> None:
    with pytest.raises(ValueError, match="label"):
        cfg({"name": "math_verify"}, {"name": "math_verify"})
    strict = {"name": "math_verify", "label": "mv_strict", "kwargs": {"require_format": True}}
    two = cfg({"name": "math_verify"}, strict)
    assert [f.key for f in two.functions] == ["math_verify", "mv_strict"]
    with pytest.raises(ValueError, match="unknown reward"):
        RewardPool(cfg({"name": "nope"}), local=True)


@pytest.mark.heavy
async def test_process_isolation_kills_a_hung_verifier(tmp_path) -> None:
    pid_file = str(tmp_path / "pids")
    name = f"{HERE}:pid_then_sleep"
    spec = {"name": name, "isolation": "process", "kwargs": {"pid_file": pid_file}}
    hang = {**spec, "label": "hang", "timeout_s": 3.0, "kwargs": {"pid_file": pid_file, "seconds": 600}}
    pool = RewardPool(cfg({**spec, "timeout_s": 60}, hang, process_slots=2), local=True)
    try:
        await pool.score(math_episode(0))  # starts both subprocesses; "hang" times out and is killed
        result = await asyncio.wait_for(pool.score(math_episode(1)), 30)
        assert result.components == {name: 1.0} and result.missing == {"hang": "timeout after 3s"}
        with open(pid_file) as f:
            pids = [int(p) for p in f.read().split()]
        worker = pool._workers[0]
        assert worker.processes.kills >= 1
        await asyncio.sleep(0.5)
        hung = [p for p in pids if p != os.getpid()]
        assert os.getpid() not in pids  # it really ran in subprocesses
        dead = []
        for pid in set(hung):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                dead.append(pid)
        assert dead, "the timed-out subprocess should have been killed"
    finally:
        pool.shutdown()


async def test_process_isolation_finds_rewards_registered_by_user_modules(tmp_path, monkeypatch) -> None:
    """A reward registered by name in an --import module resolves in the spawned subprocess too."""
    (tmp_path / "drill_rewards.py").write_text(
        "import os\nfrom agentrl.reward import register\n\n\n"
        "@register('drill_pid')\ndef drill_pid(episode):\n    return float(os.getpid())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTRL_IMPORTS", "")  # import_user_modules sets it: restored when the test ends
    from agentrl.plugins import import_user_modules

    import_user_modules(["drill_rewards"])  # what the CLI does for --import drill_rewards
    pool = RewardPool(cfg({"name": "drill_pid", "isolation": "process", "timeout_s": 60}), local=True)
    try:
        result = await asyncio.wait_for(pool.score(math_episode(0)), 60)
        assert not result.missing, result.missing
        assert result.components["drill_pid"] not in (0.0, float(os.getpid()))  # it ran in the subprocess
    finally:
        pool.shutdown()


async def test_500_episodes_two_ray_workers_slow_and_failing(ray_session) -> None:
    slow_s = 0.2
    reward_cfg = cfg(
        {"name": "math_verify", "weight": 1.0},
        {"name": f"{HERE}:slow_reward", "weight": 0.0, "kwargs": {"seconds": slow_s}},
        {"name": f"{HERE}:failing_reward"},
        {"name": f"{HERE}:sometimes_hangs", "weight": 0.0, "timeout_s": 1.0, "kwargs": {"every": 50}},
        num_workers=2,
        queue_size=256,
    )
    episodes = [math_episode(i, answer=None if i % 2 else "-1") for i in range(1, 501)]
    pool = RewardPool(reward_cfg)
    try:
        await pool.score(math_episode(1))  # actors up, modules imported
        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(pool.score(e) for e in episodes)), 300)
        wall = time.perf_counter() - start
    finally:
        pool.shutdown()
    assert len(results) == 500 and [r.episode_id for r in results] == [e.episode_id for e in episodes]
    assert all(r.score is None for r in results)  # the failing reward is configured: nothing is complete
    assert all(r.missing[f"{HERE}:failing_reward"].startswith("error: RuntimeError") for r in results)
    hung = [r for r in results if f"{HERE}:sometimes_hangs" in r.missing]
    assert len(hung) == 10 and all(r.missing[f"{HERE}:sometimes_hangs"] == "timeout after 1s" for r in hung)
    assert all(r.components[f"{HERE}:slow_reward"] == 0.5 for r in results)
    assert [r.components["math_verify"] for r in results] == [float(i % 2) for i in range(1, 501)]
    stats = pool.stats()
    assert stats["scored"] == 501 and stats["in_queue"] == 0
    assert stats["missing_by_reason"] == {"error": 501, "timeout": 10}
    assert stats["missing_by_fn"] == {f"{HERE}:failing_reward": 501, f"{HERE}:sometimes_hangs": 10}
    serial = 500 * slow_s + 10 * 1.0
    assert wall < 0.5 * serial, f"no overlap: {wall:.1f}s for a serial sum of {serial:.0f}s"
    print(f"\n500 episodes, 2 workers: {wall:.2f}s wall vs {serial:.0f}s serial sum")
