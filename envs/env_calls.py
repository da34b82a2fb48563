"""Env code (a user's `reset`, `step`, `expert_action`, constructor) run with a time limit, in every phase that
calls it outside the env managers' own executor: the warm start's expert demos, the pre-flight env check and
`agentrl check-env`.

Each call runs on a daemon thread taken from an elastic set: an idle one if there is one, else a new one. A call
past its limit raises `EnvCallTimeout` and its thread is abandoned (Python cannot stop a thread; daemon, it never
holds up the exit; it rejoins the idle ones if the call ever returns). A fixed pool would not do: every hung call
keeps one of its few workers, and once they are all taken every later call waits in its queue past its own limit
(measured: a Sokoban that sleeps 30 s on 2% of steps failed every RL episode behind a 16-thread pool).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


class EnvCallTimeout(TimeoutError):
    """An env call that did not return within its limit."""


class _Worker:
    """A daemon thread that runs one job at a time and goes back to the idle set after each."""

    idle: list[_Worker] = []  # noqa: RUF012 - shared by design: one set of threads per process
    lock = threading.Lock()
    made = 0

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        _Worker.made += 1
        threading.Thread(target=self._loop, name=f"env-call-{_Worker.made}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, args, kwargs, done = self.jobs.get()
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # handed to the caller, which re-raises it
                ok, value = False, err
            else:
                ok, value = True, result
            del fn, args, kwargs  # nothing of the job outlives it on an idle thread
            with _Worker.lock:
                _Worker.idle.append(self)
            done(ok, value)


def _start(fn: Callable, args: tuple, kwargs: dict, done: Callable[[bool, Any], None]) -> None:
    with _Worker.lock:
        worker = _Worker.idle.pop() if _Worker.idle else None
    (worker or _Worker()).jobs.put((fn, args, kwargs, done))


def call_with_timeout(fn: Callable, *args: Any, timeout_s: float, what: str = "env call", **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, or EnvCallTimeout after `timeout_s` seconds; `fn`'s own exception is raised as is."""
    box: list = []
    finished = threading.Event()

    def done(ok: bool, value: Any) -> None:
        box.append((ok, value))
        finished.set()

    _start(fn, args, kwargs, done)
    if not finished.wait(timeout_s):
        raise EnvCallTimeout(f"{what} timed out after {timeout_s:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


async def acall_with_timeout(fn: Callable, *args: Any, timeout_s: float, what: str = "env call", **kwargs: Any) -> Any:
    """The same from a coroutine, without blocking its event loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def done(ok: bool, value: Any) -> None:
        def settle() -> None:
            if future.done():  # timed out already: nobody waits for it
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop has closed since: the caller gave up long ago
            pass

    _start(fn, args, kwargs, done)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        raise EnvCallTimeout(f"{what} timed out after {timeout_s:g}s") from None


class BoundedEnv:
    """An env whose every method call runs under `call_with_timeout`; attributes that are not methods pass through.
    For the synchronous checks (pre-flight, check-env), which call the env in many places."""

    def __init__(self, env: Any, timeout_s: float) -> None:
        self._env, self._timeout_s = env, timeout_s

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._env, name)
        if not callable(value):
            return value

        def bounded(*args: Any, **kwargs: Any) -> Any:
            return call_with_timeout(value, *args, timeout_s=self._timeout_s, what=f"env.{name}", **kwargs)

        return bounded

    @property
    def unwrapped(self) -> Any:
        return self._env
