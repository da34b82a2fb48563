"""RemoteEngine: request/response mapping for each flavour over httpx.MockTransport (fast), then one real
`vllm serve` (CPU build, tiny model) reached over HTTP: token ids in, token ids + one log-prob per token out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import httpx
import pytest

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import EngineError, RetryableEngineError
from agentrl.rollout.remote_engine import RejectedError, RemoteEngine
from tests.servers import free_port

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


class FakeServer:
    """A scripted server: records every request; generation blocks while `hold` is set, until aborted."""

    def __init__(self, flavor: str, weights_endpoint: bool = True):
        self.flavor = flavor
        self.weights_endpoint = weights_endpoint
        self.requests: list[tuple[str, dict]] = []
        self.hold = False
        self.aborted: set[str] = set()
        self.busy_resets = 0  # this many /reset_prefix_cache calls answer success=false (requests hold KV blocks)

    def _tokens(self, n: int) -> list[int]:
        return [100 + i for i in range(n)]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.requests.append((path, body))
        if path == "/health":
            return httpx.Response(200)
        if path == "/get_model_info":
            if self.flavor == "sglang":
                return httpx.Response(200, json={"model_path": "/m", "is_generation": True})
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/openapi.json":
            paths = {"/v1/completions": {}, **({"/inference/v1/generate": {}} if self.flavor == "vllm" else {})}
            return httpx.Response(200, json={"paths": paths})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if path in ("/generate", "/inference/v1/generate", "/v1/completions"):
            return await self._generate(path, body)
        if path == "/abort_request":
            self.aborted.add(body["rid"])
            return httpx.Response(200)
        if path == "/inference/v1/abort_requests":
            self.aborted.update(body["request_ids"])
            return httpx.Response(200)
        if path == "/reset_prefix_cache" and self.weights_endpoint:
            self.requests[-1] = (path, dict(request.url.params))
            self.busy_resets -= 1
            return httpx.Response(200, json={"success": self.busy_resets < 0})
        if path in ("/update_weights_from_disk", "/collective_rpc") and self.weights_endpoint:
            ok = not str(body.get("model_path", "")).endswith("bad")
            return httpx.Response(200 if ok else 400, json={"success": ok, "message": "loaded" if ok else "bad dir"})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def _generate(self, path: str, body: dict) -> httpx.Response:
        rid = body.get("rid") or ("generate-tokens-" + body["request_id"] if "request_id" in body else "openai")
        n = (body.get("sampling_params") or body).get("max_new_tokens") or (body.get("sampling_params") or body)[
            "max_tokens"
        ]
        reason = "length"
        if self.hold:
            while rid not in self.aborted:
                await asyncio.sleep(0.005)
            n, reason = 3, "abort"
        ids = self._tokens(n)
        lps = [-0.25 * (i + 1) for i in range(n)]
        if path == "/generate":
            meta = {
                "finish_reason": {"type": reason},
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
            }
            return httpx.Response(200, json={"output_ids": ids, "meta_info": meta})
        if path == "/inference/v1/generate":
            content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
            choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": reason}
            return httpx.Response(200, json={"request_id": rid, "choices": [choice]})
        logprobs = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps}
        return httpx.Response(
            200, json={"choices": [{"index": 0, "text": "", "logprobs": logprobs, "finish_reason": reason}]}
        )


def _engine(server: FakeServer, **kwargs) -> RemoteEngine:
    return RemoteEngine("http://fake:1", transport=httpx.MockTransport(server), abort_grace_s=0.2, **kwargs)


async def test_sglang_flavor_mapping():
    server = FakeServer("sglang")
    engine = _engine(server)
    assert (await engine.start())["flavor"] == "sglang"
    out = await engine.generate(PROMPT, SamplingConfig(max_tokens=4, top_k=5, seed=9), "s1")
    path, body = server.requests[-1]
    assert path == "/generate" and body["input_ids"] == PROMPT and body["rid"] == "s1" and body["return_logprob"]
    assert body["sampling_params"]["max_new_tokens"] == 4 and body["sampling_params"]["top_k"] == 5
    assert body["sampling_params"]["sampling_seed"] == 9
    assert out.token_ids == [100, 101, 102, 103] and out.logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert out.finish_reason == "length" and out.version == 0

    server.hold = True
    task = asyncio.ensure_future(engine.generate(PROMPT, SamplingConfig(max_tokens=50), "s2"))
    await asyncio.sleep(0.05)
    await engine.update_weights("/snap/v1", 1)
    pre = await asyncio.wait_for(task, 5)
    assert pre.preempted and pre.finish_reason == "abort" and pre.token_ids == [100, 101, 102] and pre.version == 0
    assert ("/update_weights_from_disk", {"model_path": "/snap/v1"}) in server.requests
    server.hold = False
    assert (await engine.generate(PROMPT, SamplingConfig(max_tokens=1), "s3")).version == 1
    with pytest.raises(EngineError, match="bad dir"):
        await engine.update_weights("/snap/bad", 2)
    assert (await engine.stats())["version"] == 1


async def test_vllm_generate_flavor_mapping_and_abort_returns_partial_tokens():
    server = FakeServer("vllm")
    engine = _engine(server)
    await engine.start()
    assert engine.flavor == "vllm"
    out = await engine.generate(PROMPT, SamplingConfig(max_tokens=3, temperature=0.0, ignore_eos=True), "v1")
    path, body = server.requests[-1]
    assert path == "/inference/v1/generate" and body["token_ids"] == PROMPT and body["request_id"] == "v1"
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 3 and sp["logprobs"] == 0 and sp["detokenize"] is False and sp["ignore_eos"] is True
    assert out.token_ids == [100, 101, 102] and len(out.logprobs) == 3

    server.hold = True
    task = asyncio.ensure_future(engine.generate(PROMPT, SamplingConfig(max_tokens=50), "v2"))
    await asyncio.sleep(0.05)
    await engine.abort("v2")
    part = await asyncio.wait_for(task, 5)
    assert part.finish_reason == "abort" and not part.preempted and part.token_ids == [100, 101, 102]
    assert ("/inference/v1/abort_requests", {"request_ids": ["generate-tokens-v2"]}) in server.requests
    server.hold = False
    await engine.update_weights("/snap/v1", 1)
    assert ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/snap/v1"}}) in server.requests

    assert server.requests[-1] == ("/reset_prefix_cache", {})

    no_dev = _engine(FakeServer("vllm", weights_endpoint=False))
    with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE"):
        await no_dev.update_weights("/snap/v1", 1)


async def test_a_refused_prefix_cache_reset_is_retried_preempting_then_fails_the_sync():
    """vLLM answers {"success": false} while requests hold KV blocks: the engine asks once more with
    reset_running_requests=true; a second refusal fails the update (stale prefixes must not be reused)."""
    server = FakeServer("vllm")
    engine = _engine(server)
    server.busy_resets = 1
    await engine.update_weights("/snap/v1", 1)
    resets = [r for r in server.requests if r[0] == "/reset_prefix_cache"]
    assert resets == [("/reset_prefix_cache", {}), ("/reset_prefix_cache", {"reset_running_requests": "true"})]
    assert (await engine.stats())["version"] == 1

    server.busy_resets = 2
    with pytest.raises(EngineError, match="refused to reset its prefix cache"):
        await engine.update_weights("/snap/v2", 2)
    assert (await engine.stats())["version"] == 1


async def test_openai_flavor_mapping_and_abort_cancels():
    server = FakeServer("openai")
    engine = _engine(server)
    await engine.start()
    assert engine.flavor == "openai" and engine.model == "tiny"
    out = await engine.generate(PROMPT, SamplingConfig(max_tokens=2, stop_token_ids=[3]), "o1")
    path, body = server.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == PROMPT and body["model"] == "tiny"
    assert body["return_tokens_as_token_ids"] is True and body["logprobs"] == 0 and body["stop_token_ids"] == [3]
    assert out.token_ids == [100, 101] and out.logprobs == [-0.25, -0.5]

    server.hold = True
    task = asyncio.ensure_future(engine.generate(PROMPT, SamplingConfig(max_tokens=50), "o2"))
    await asyncio.sleep(0.05)
    await engine.abort("o2")
    part = await asyncio.wait_for(task, 5)
    assert part.finish_reason == "abort" and part.token_ids == [] and part.logprobs == []


async def test_http_errors_map_to_engine_errors():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            prompt = json.loads(request.content)["prompt"]
            if prompt == [1]:
                return httpx.Response(400, json={"error": {"message": "prompt too long", "code": 400}})
            return httpx.Response(503, json={"error": "overloaded"})
        return httpx.Response(200, json={"data": []})

    engine = RemoteEngine("http://fake:1", flavor="openai", transport=httpx.MockTransport(handler))
    with pytest.raises(EngineError, match="prompt too long") as err:
        await engine.generate([1], SamplingConfig(max_tokens=1), "e1")
    assert not isinstance(err.value, RetryableEngineError)
    assert isinstance(err.value, RejectedError) and err.value.status == 400
    again = pickle.loads(pickle.dumps(err.value))  # errors cross Ray actors pickled
    assert again.status == 400 and str(again) == str(err.value)
    with pytest.raises(RetryableEngineError, match="overloaded"):
        await engine.generate([2], SamplingConfig(max_tokens=1), "e2")


@pytest.fixture(scope="module")
def vllm_server(tiny_model_path, tmp_path_factory):
    """`vllm serve` on CPU with the token endpoint (--enable-scale-out) and dev endpoints (weight reload)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_serve") / "server.log"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        # engine core and worker in the server process: one vLLM import instead of three (start ~3x faster here)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    cmd = [
        # `python -m` rather than the `vllm` script: that one asks for the "vllm" distribution, absent under vllm-cpu
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_path, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--enable-scale-out", "--seed", "0", "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the server and every process it started
        proc.wait()


@pytest.mark.parametrize("flavor", ["auto", "openai"])
async def test_real_vllm_server_token_in_token_out(vllm_server, flavor):
    engine = RemoteEngine(vllm_server, flavor=flavor, request_timeout_s=60)
    await engine.start()
    assert engine.flavor == ("vllm" if flavor == "auto" else "openai")
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, ignore_eos=True, seed=1)
    outs = await asyncio.gather(*(engine.generate([*PROMPT, i], sampling, f"{flavor}-{i}") for i in range(4)))
    for out in outs:
        assert len(out.token_ids) == 16 and len(out.logprobs) == 16 and out.finish_reason == "length"
        assert all(isinstance(t, int) and t >= 0 for t in out.token_ids) and all(lp <= 0.0 for lp in out.logprobs)
    greedy = SamplingConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert (await engine.generate(PROMPT, greedy, "g1")).token_ids == (
        await engine.generate(PROMPT, greedy, "g2")
    ).token_ids
    await engine.aclose()


async def test_real_vllm_server_abort_and_weight_reload(vllm_server, tiny_model_path):
    engine = RemoteEngine(vllm_server, request_timeout_s=60)
    # The server shows no progress: abort after a wait that lands mid-generation, whatever the machine's speed
    # (under load no token may have come yet; unloaded, all 1900 may have).
    for wait_s in (0.3, 1.0, 3.0, 9.0):
        rid = f"long-{wait_s}"
        task = asyncio.ensure_future(engine.generate(PROMPT, SamplingConfig(max_tokens=1900, ignore_eos=True), rid))
        await asyncio.sleep(wait_s)
        await engine.abort(rid)
        part = await asyncio.wait_for(task, 30)
        if part.token_ids and part.finish_reason == "abort":
            break
    assert (
        part.finish_reason == "abort" and 0 < len(part.token_ids) < 1900 and len(part.logprobs) == len(part.token_ids)
    )
    assert await engine.update_weights(tiny_model_path, 1) < 30
    assert (await engine.generate(PROMPT, SamplingConfig(max_tokens=2), "after")).version == 1
    await engine.aclose()


async def test_dead_server_is_retryable_quickly():
    engine = RemoteEngine(f"http://127.0.0.1:{free_port()}", flavor="vllm", start_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RetryableEngineError):
        await engine.generate(PROMPT, SamplingConfig(max_tokens=4), "dead")
    assert time.monotonic() - t0 < 5
    assert (await engine.health())["ok"] is False
