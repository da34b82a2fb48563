"""Remote HTTP backend: an already running SGLang or vLLM server behind the RolloutEngine contract.

Flavours (the `flavor` kwarg, or "auto" to detect from the server):

- "sglang": SGLang's native POST /generate with input_ids; POST /abort_request returns the request with its
  partial tokens; POST /update_weights_from_disk loads a safetensors snapshot dir.
- "vllm": vLLM's token-in/token-out POST /inference/v1/generate (vLLM >= 0.32, `vllm serve --enable-scale-out`
  or `--tokens-only`); POST /inference/v1/abort_requests returns the request with its partial tokens. Weight updates
  need the server's dev endpoints (VLLM_SERVER_DEV_MODE=1): POST /collective_rpc reload_weights, then
  /reset_prefix_cache.
- "openai": the OpenAI-compatible POST /v1/completions with a token-id prompt, logprobs and
  return_token_ids / return_tokens_as_token_ids (vLLM's extensions). Abort cancels the HTTP request (vLLM aborts
  on disconnect) and the protocol returns nothing, so an aborted request comes back with no tokens. Weight updates
  use the same dev endpoints as "vllm".

Connection errors, timeouts and 5xx answers raise RetryableEngineError (another engine may serve the request);
4xx answers raise RejectedError (an EngineError with the status code) with the server's message.

Behaviour log-probs: the trainer's are of the distribution the tokens were drawn from (temperature, then top-k /
top-p, renormalised: `agentrl.trainer.losses.SamplingDist`), like the in-process vLLM engine's. The server decides
what it reports, and no request field changes it: a vLLM server ("vllm", "openai") must be started with
`--logprobs-mode processed_logprobs` (its default, raw_logprobs, is the model's distribution before temperature,
top-k and top-p; the two agree only at temperature 1 without top-k / top-p). An SGLang server reports
log(softmax(logits / T)): after the temperature, before top-k / top-p, so it matches with top_p 1 and top_k -1
only (SGLANG_RETURN_ORIGINAL_LOGPROB=1 would drop the temperature too: leave it unset). A mismatch shows as a
large `train/rollout_logprob_diff`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import httpx

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import Completion, EngineError, GatedEngine, RetryableEngineError, finish_reason
from agentrl.rollout.sglang_protocol import parse_sglang_output, sglang_request
from agentrl.rollout.turn_mailbox import TurnMailbox

Flavor = Literal["auto", "sglang", "vllm", "openai"]
VLLM_ID_PREFIX = "generate-tokens-"  # vLLM's /inference/v1/generate prefixes the caller's request_id with this


class RejectedError(EngineError):
    """The server answered with a 4xx status: the request itself is wrong, retrying it elsewhere will not help."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        """Errors cross Ray actors pickled; the default reduce would rebuild it without the status."""
        return type(self), (str(self), self.status)


def _server_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]


def vllm_sampling(s: SamplingConfig) -> dict[str, Any]:
    """vLLM SamplingParams fields as JSON: token ids out, log-prob of the sampled token, no detokenising."""
    return {
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else 0,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "seed": s.seed,
        "logprobs": 0,
        "detokenize": False,
    }


def parse_vllm_generate(body: dict[str, Any]) -> Completion:
    """choices[0].token_ids and logprobs.content[i].logprob from /inference/v1/generate."""
    choice = body["choices"][0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if [int(c["token_id"]) for c in content] != ids:
        raise EngineError("vLLM generate: logprobs.content does not match token_ids")
    return ids, [float(c["logprob"]) for c in content], finish_reason(choice.get("finish_reason"))


def openai_completion_body(token_ids: list[int], s: SamplingConfig, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": list(token_ids),
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": s.ignore_eos,
        "stop_token_ids": list(s.stop_token_ids),
        "skip_special_tokens": False,
    }
    if model:
        body["model"] = model
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def parse_openai_completion(body: dict[str, Any]) -> Completion:
    """Token ids from choices[0].token_ids, else from logprobs.tokens ("token_id:123"); token_logprobs alongside."""
    choice = body["choices"][0]
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        try:
            ids = [int(str(t).rsplit("token_id:", 1)[1]) for t in lp.get("tokens") or []]
        except IndexError:
            raise EngineError("completion tokens are not token ids: set return_tokens_as_token_ids") from None
    logprobs = [float("nan") if v is None else float(v) for v in lp.get("token_logprobs") or []]
    return [int(t) for t in ids], logprobs, finish_reason(choice.get("finish_reason"))


class RemoteEngine(TurnMailbox, GatedEngine):
    """One running server, reached over a pooled async httpx client."""

    def __init__(
        self,
        url: str,
        *,
        flavor: Flavor = "auto",
        model: str | None = None,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        start_timeout_s: float = 60.0,
        abort_grace_s: float = 5.0,
        max_connections: int = 1024,
        version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(version)
        self.url = url.rstrip("/")
        self.flavor: Flavor = flavor
        self.model = model
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._transport = transport
        self._start_timeout_s = start_timeout_s
        self._abort_grace_s = abort_grace_s
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()
        self._grace: dict[str, asyncio.TimerHandle] = {}
        self._start_lock = asyncio.Lock()
        self._started = False

    # ---- HTTP ------------------------------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url, timeout=self._timeout, limits=self._limits, transport=self._transport
            )
        return self._client

    async def _request(self, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> httpx.Response:
        extra = {} if timeout is None else {"timeout": timeout}
        try:
            response = await self._http().request(method, path, **extra, **kwargs)
        except httpx.TransportError as err:
            raise RetryableEngineError(f"{self.url}{path}: {type(err).__name__}: {err}") from err
        if response.status_code >= 500:
            raise RetryableEngineError(f"{self.url}{path}: HTTP {response.status_code}: {_server_message(response)}")
        if response.status_code >= 400:
            message = f"{self.url}{path}: HTTP {response.status_code}: {_server_message(response)}"
            raise RejectedError(message, response.status_code)
        return response

    async def _post(self, path: str, body: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        response = await self._request("POST", path, json=body, **kwargs)
        return response.json() if response.content else None

    # ---- start and flavour detection -------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Wait for /health (up to start_timeout_s) and pick the flavour; idempotent."""
        if self._started:
            return {"flavor": self.flavor, "version": self._version}
        async with self._start_lock:
            if not self._started:
                deadline = time.monotonic() + self._start_timeout_s
                while True:
                    try:
                        await self._request("GET", "/health", timeout=5.0)
                        break
                    except RetryableEngineError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                if self.flavor == "auto":
                    self.flavor = await self._detect()
                if self.flavor == "openai" and self.model is None:
                    models = (await self._request("GET", "/v1/models")).json().get("data") or []
                    self.model = models[0]["id"] if models else None
                self._started = True
        return {"flavor": self.flavor, "version": self._version}

    async def _detect(self) -> Flavor:
        """SGLang answers /get_model_info; a vLLM server lists /inference/v1/generate in its OpenAPI schema only
        when that endpoint is enabled; anything else is treated as OpenAI-compatible."""
        try:
            info = (await self._request("GET", "/get_model_info", timeout=10.0)).json()
            if isinstance(info, dict) and "model_path" in info:
                return "sglang"
        except EngineError:
            pass
        try:
            paths = (await self._request("GET", "/openapi.json", timeout=10.0)).json().get("paths", {})
        except (EngineError, ValueError):
            return "openai"
        return "vllm" if "/inference/v1/generate" in paths else "openai"

    # ---- requests --------------------------------------------------------------------------------------------
    async def _call(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> Completion:
        if self.flavor == "sglang":
            return parse_sglang_output(await self._post("/generate", sglang_request(token_ids, sampling, request_id)))
        if self.flavor == "vllm":
            body = {"request_id": request_id, "token_ids": list(token_ids), "sampling_params": vllm_sampling(sampling)}
            return parse_vllm_generate(await self._post("/inference/v1/generate", body))
        return parse_openai_completion(
            await self._post("/v1/completions", openai_completion_body(token_ids, sampling, self.model))
        )

    async def _complete(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> Completion:
        task = asyncio.ensure_future(self._call(token_ids, sampling, request_id))
        self._tasks[request_id] = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if request_id in self._cancelled and task.cancelled():
                return [], [], "abort"  # abort() cancelled the HTTP request: the protocol returned no tokens
            task.cancel()
            raise
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise EngineError(f"{self.url}: malformed {self.flavor} response for {request_id}: {err!r}") from err
        finally:
            self._tasks.pop(request_id, None)
            self._cancelled.discard(request_id)
            handle = self._grace.pop(request_id, None)
            if handle is not None:
                handle.cancel()

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            self._cancelled.add(request_id)
            task.cancel()

    async def _abort_ids(self, request_ids: list[str]) -> None:
        """Server-side abort where the protocol has one (the request then returns its partial tokens); the HTTP
        request is cancelled after abort_grace_s if the server has not answered by then, or at once for openai."""
        if self.flavor == "sglang":
            await asyncio.gather(*(self._post("/abort_request", {"rid": rid}) for rid in request_ids))
        elif self.flavor == "vllm":
            await self._post("/inference/v1/abort_requests", {"request_ids": [VLLM_ID_PREFIX + r for r in request_ids]})
        else:
            for rid in request_ids:
                self._cancel(rid)
            return
        loop = asyncio.get_running_loop()
        for rid in request_ids:
            if rid in self._tasks:
                self._grace[rid] = loop.call_later(self._abort_grace_s, self._cancel, rid)

    async def _load_weights(self, source: str, version: int) -> None:
        if self.flavor == "sglang":
            result = await self._post("/update_weights_from_disk", {"model_path": source})
            if isinstance(result, dict) and not result.get("success", True):
                raise EngineError(f"{self.url}: update_weights_from_disk failed: {result.get('message')}")
            return
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": source}}
            await self._post("/collective_rpc", rpc)
        except RejectedError as err:
            if err.status == 404:
                raise EngineError(
                    f"{self.url}: this vLLM server exposes no weight-update endpoint; start it with "
                    "VLLM_SERVER_DEV_MODE=1 (POST /collective_rpc reload_weights) or restart it on the new weights"
                ) from None
            raise
        await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        """vLLM's POST /reset_prefix_cache answers {"success": false} while requests hold KV blocks (0.32 read:
        entrypoints/serve/dev/cache/api_router.py): our requests are drained, but the server may still be
        finishing their aborts, or serve other clients. Tried once more with reset_running_requests=true (the
        server preempts what still runs; those requests recompute their KV on the new weights); a second refusal
        fails the sync rather than leave prefixes of the old weights in use. A server that answers without a body
        (older vLLM) reports nothing to check."""
        if not _refused(await self._post("/reset_prefix_cache")):
            return
        if _refused(await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})):
            raise EngineError(
                f"{self.url}: the server refused to reset its prefix cache after loading new weights (requests "
                "still hold KV blocks even when preempted): stale KV prefixes would be reused"
            )

    async def health(self) -> dict[str, Any]:
        try:
            await self._request("GET", "/health", timeout=5.0)
            ok = True
        except EngineError:
            ok = False
        return {"ok": ok, "version": self._version, "paused": not self._gate.is_set(), "flavor": self.flavor}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _refused(result: Any) -> bool:
    """A /reset_prefix_cache answer that says the reset did not happen."""
    return isinstance(result, dict) and result.get("success") is False
