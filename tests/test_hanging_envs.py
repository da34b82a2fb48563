"""A hanging or crashing env ends no phase that calls user code: every env call is bounded by envs.call_timeout_s
(check-env: --timeout-s), what fails or hangs is counted and skipped (the RL path's rule), and the phase finishes.

Phases here: the warm start's expert demos (played concurrently), the pre-flight env check and `agentrl
check-env`. The RL episodes, validation and `agentrl rollout` play through the env managers' EpisodeRunner, whose
hanging-env test is in tests/test_envmanager_scripted.py. The env (tests/Hanging-v0) sleeps 30 s where it hangs;
each test's own timeout is far below what one unbounded hang would take.
"""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

import tests.envs_fixtures  # noqa: F401 - registers tests/Hanging-v0
from agentrl.config import load_config
from agentrl.envmanager.manager import _make_each_env
from agentrl.envs.checker import check_text_env
from agentrl.envs.env_calls import EnvCallTimeout, acall_with_timeout, call_with_timeout
from agentrl.run.warm_start import DEMO_SEED_OFFSET, expert_samples

HANG = "tests/Hanging-v0"


def test_bounded_calls_return_raise_and_time_out() -> None:
    assert call_with_timeout(lambda x, y=0: x + y, 1, y=2, timeout_s=1) == 3
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, timeout_s=1)
    with pytest.raises(EnvCallTimeout, match=r"env\.step timed out after 0\.2s"):
        call_with_timeout(time.sleep, 30, timeout_s=0.2, what="env.step")


async def test_async_bounded_call_leaves_the_loop_free() -> None:
    import asyncio

    ticks = []

    async def ticker():
        for _ in range(5):
            ticks.append(1)
            await asyncio.sleep(0.01)

    with pytest.raises(EnvCallTimeout):
        await asyncio.gather(acall_with_timeout(time.sleep, 30, timeout_s=0.3), ticker())
    assert len(ticks) == 5


@pytest.mark.timeout(60)
def test_warm_start_demos_skip_hanging_and_crashing_episodes(tiny_model_path: str) -> None:
    """12 demo episodes, seeds DEMO_SEED_OFFSET + i: every 3rd hangs 30 s in step, every 4th raises. Serial and
    unbounded this took 4 x 30 s; bounded and concurrent it finishes in about one timeout."""
    overrides = [
        "envs.train={count: {env_id: tests/Hanging-v0, kwargs: {every: 3, raise_every: 4}}}",
        "envs.val={}",
        "envs.call_timeout_s=1.0",
        "tools.sets={}",
    ]
    cfg = load_config(None, overrides)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ticks = []
    demos = expert_samples(cfg, tokenizer, 12, tick=lambda: ticks.append(1))
    seeds = [DEMO_SEED_OFFSET + i for i in range(12)]
    bad = [s for s in seeds if s % 3 == 0 or s % 4 == 1]
    assert demos.failed_episodes == len(bad) and len(ticks) == 12
    played = {s.episode_id for s in demos}
    assert len(played) == 12 - len(bad) and len(demos) == 3 * len(played)  # CountTo(3): 3 turns an episode
    order = [s.episode_id for s in demos]
    assert order == sorted(order, key=order.index) and order == [e for e in order if e]  # episode order kept


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hang_in", ["init", "reset"])
def test_preflight_env_check_names_the_hanging_env(hang_in: str) -> None:
    envs = [("envs.train.ok", "tests/CountTo-v0", {}, 0, None, False),
            ("envs.train.bad", HANG, {"hang_in": hang_in}, 0, None, False)]  # fmt: skip
    problem = _make_each_env(envs, 0.5)
    assert problem is not None and problem.startswith("envs.train.bad: tests/Hanging-v0:")
    assert "timed out after 0.5s" in problem and "envs.call_timeout_s" in problem


@pytest.mark.timeout(30)
def test_check_env_reports_a_hanging_step_as_a_violation() -> None:
    report = check_text_env(HANG, {"every": 1000}, episodes=3, seed=1000, timeout_s=0.5)  # seed 1000 hangs
    assert not report["ok"]
    assert any("env.step timed out after 0.5s" in v for v in report["violations"]), report["violations"]
