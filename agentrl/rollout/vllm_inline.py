"""vLLM's engine core inside the engine actor, stepped by the actor's event loop: the CPU default.

AsyncLLM runs the engine core in a child process and talks to it over ZMQ (msgpack both ways, a busy loop on each
side). On CPU those two processes share the cores with the trainer and the env managers, and the traffic between
them cost ~40% of the engine's CPU per request (measured on step-wise Sokoban, 48 requests in flight: 2.56 ms of CPU
per request with the core in its own process, 1.58 ms inline). `InlineLLM` holds vLLM's `LLMEngine` with its core
in this process and offers the part of AsyncLLM's surface that `VLLMEngine` calls, so the engine has one code path.
On accelerators the core keeps its own process, where its busy loop overlaps scheduling with the device's work.

One engine step (a forward over every running sequence) runs on the event loop and blocks it for its duration
(milliseconds on CPU); requests that arrive meanwhile join the next step, as they would in vLLM's own loop.
A weight load runs on a thread, so the actor still answers health checks while a broadcast is received.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from agentrl.rollout.base import EngineDeadError, EngineError


class InlineLLM:
    """The AsyncLLM methods `VLLMEngine` uses (generate, abort, collective_rpc, reset_prefix_cache, errored,
    shutdown), over an in-process `LLMEngine`. Any failure of an engine step is the core's death, as it is for
    AsyncLLM: every waiting request fails with EngineDeadError and `errored` stays true."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else from_engine_args starts a core process anyway
        self._engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
        self.model_config = self._engine.model_config
        self.output_processor = self._engine.output_processor
        self._waiting: dict[str, asyncio.Future] = {}
        self._driver: asyncio.Task | None = None
        self._core = asyncio.Lock()  # an engine step and a weight load never overlap
        self._death = ""

    @property
    def errored(self) -> bool:
        return bool(self._death)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """The request's final output (params ask for FINAL_ONLY); an abort yields its tokens so far."""
        if self._death:
            raise EngineDeadError(f"vLLM engine core died: {self._death}")
        done = asyncio.get_running_loop().create_future()
        self._engine.add_request(request_id, prompt, params)
        self._waiting[request_id] = done
        if self._driver is None:
            self._driver = asyncio.ensure_future(self._drive())
        yield await done

    async def _drive(self) -> None:
        """Step the engine while it has work, handing each finished output to its request."""
        try:
            while self._engine.has_unfinished_requests():
                async with self._core:
                    outputs = self._engine.step()
                for out in outputs:
                    done = self._waiting.pop(out.request_id, None)
                    if out.finished and done is not None and not done.done():
                        done.set_result(out)
                await asyncio.sleep(0)  # new requests and aborts get in between two steps
        except Exception as err:
            self._die(f"{type(err).__name__}: {err}")
        finally:
            self._driver = None  # no await since the loop's last check: a request added later starts a new driver

    def _die(self, why: str) -> None:
        self._death = why
        waiting, self._waiting = self._waiting, {}
        for done in waiting.values():
            if not done.done():
                done.set_exception(EngineDeadError(f"vLLM engine core died: {why}"))

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests now; each ends with the tokens it has so far (finish reason "abort"), as in AsyncLLM."""
        from vllm.v1.engine import FinishReason

        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        processor = self._engine.output_processor
        for rid in ids:
            done = self._waiting.pop(rid, None)
            if done is None or done.done():
                continue
            states = [processor.request_states.get(i) for i in processor.external_req_ids.get(rid, ())]
            state = next((s for s in states if s is not None), None)
            if state is None:
                done.set_exception(EngineError(f"vLLM lost request {rid} (aborted, but it had no state)"))
            else:
                done.set_result(state.make_request_output([], None, FinishReason.ABORT, None))
        self._engine.abort_request(ids)

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        async with self._core:
            return await asyncio.to_thread(self._engine.collective_rpc, method, kwargs=kwargs)

    async def reset_prefix_cache(self) -> bool:
        async with self._core:
            return self._engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self._die("shut down")
        self._engine.engine_core.shutdown()
