"""Agent gateway overhead: CPU per model call through the gateway vs a direct engine call, and calls/s against
vLLM's own OpenAI-compatible server on the same model, side by side in one run. Prints one JSON object.

    python benchmarks/bench_gateway.py [--agents 64 256] [--turns 6] [--tokens 16] [--repeats 5]

Every agent plays the same multi-turn conversation: the rules and a Sokoban grid with the `move` tool, then each
reply and a new grid appended (so the gateway's token reuse path runs, as for a real agent). Every call generates
exactly `--tokens` tokens (ignore_eos), so each side does the same engine work.

- `direct`: the env manager's own path, token ids straight to the engine (agentrl's engine actor behind the router,
  `EngineClient`), prompts rendered by `ChatTokens` as the env manager does.
- `gateway`: the same agents written with the `openai` SDK, each given `Gateway.client` as an agent function is
  (the gateway's app called in process), which renders, reuses the episode's tokens, generates on the same engine
  and parses tool calls.
- `gateway_http`: the same over loopback HTTP, as an agent command (another process) reaches it.
- `agent_sdk_alone`: the same SDK agents answered by httpx's MockTransport (no server, no engine): what the agent's
  own SDK costs per call against any endpoint.
- `direct_with_sdk`: each turn, the SDK agent's call answered by MockTransport and then the direct path's engine
  call: the agent's SDK paid in full (its CPU, and the time it adds between one agent's engine calls, which at few
  agents leaves the engine smaller batches to run) against an endpoint that costs nothing.
- `vllm_serve`: the same SDK agents against `vllm serve` on the same model (a subprocess; started after agentrl's
  engine is gone, never beside it), the endpoint a user would point agents at otherwise.

CPU is the machine's (user + system time from /proc/stat, every process: this one, the engine's, Ray's), over the
calls made, on an otherwise idle machine. The sides take turns, `--repeats` runs each, and every figure is the
median of its side's runs (single runs of one side varied by up to 40% here). `overhead` = (gateway - direct -
agent_sdk_alone) / gateway CPU per call, one ratio per repeat (its sides ran back to back) and the median of those:
the gateway's share of a gateway turn's CPU, the agent's own SDK left out (it costs the same whichever endpoint the
agent talks to); `overhead_with_sdk` keeps it in. `overhead_vs_direct_with_sdk` = (gateway - direct_with_sdk) /
gateway, paired alike: the same SDK agent with and without the gateway between it and the engine, so the SDK's
own effect on the engine's batches is left out too. Targets: overhead <=
0.10, `vs_vllm_serve` >= 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

SYSTEM = "Sokoban: push each box X onto a target O.\nMake one move per turn with the move tool."
GRID = "######\n##___#\n#_O_##\n#__XP#\n#___##\n######"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--agents", type=int, nargs="+", default=[64, 256])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="runs of each side, interleaved; medians reported")
    return p.parse_args()


def _cpu_s() -> float:
    """User + system CPU seconds of the whole machine so far."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def _messages(i: int, turn: int, replies: list[str]) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{GRID}\n(agent {i})"}]
    for t, reply in enumerate(replies[:turn]):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"{GRID}\n(turn {t})"}]
    return messages


async def _measure(play, agents: int, turns: int) -> dict[str, float]:
    await asyncio.gather(*(play(i, 2) for i in range(min(agents, 16))))  # warm-up
    cpu0, own0, t0 = _cpu_s(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(play(i, turns) for i in range(agents)))
    seconds, calls = time.perf_counter() - t0, agents * turns
    return {
        "calls_per_s": calls / seconds,
        "cpu_ms_per_call": 1000 * (_cpu_s() - cpu0) / calls,
        "of_it_this_process": 1000 * (time.process_time() - own0) / calls,  # the agents (and the gateway, if any)
        "seconds": seconds,
    }


async def _interleaved(plays: dict[str, Any], agents: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each side measured `--repeats` times, in turn (A B C D A B C D ...), so that the machine's drift between
    hours and minutes falls on every side alike; each figure is the median of its side's runs."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in plays}
    for _ in range(args.repeats):
        for name, play in plays.items():
            runs[name].append(await _measure(play, agents, args.turns))
    return {name: _median_of(r) for name, r in runs.items()}


def _median_of(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["cpu_ms_per_call_runs"] = [round(r["cpu_ms_per_call"], 2) for r in runs]
    return out


def _sdk_player(client_for, model: str, tokens: int, tools: list[dict], extra: dict | None = None, done=None):
    """An agent: `client_for(i, turns)` gives agent i its `openai.AsyncOpenAI`; `done(i, turns)` ends its episode."""

    async def play(i: int, turns: int) -> None:
        client = client_for(i, turns)
        replies: list[str] = []
        for turn in range(turns):
            r = await client.chat.completions.create(
                model=model, messages=_messages(i, turn, replies), tools=tools, max_tokens=tokens, extra_body=extra,
            )  # fmt: skip
            replies.append(r.choices[0].message.content or "")
        if done is not None:
            done(i, turns)

    return play


def _canned_clients(tokens: int):
    """Clients whose every call gets the same reply from httpx's MockTransport, with no server or engine behind
    it: what the agent's own `openai` SDK costs per call, whichever endpoint it talks to."""
    import openai

    reply = {
        "id": "chatcmpl-canned", "object": "chat.completion", "created": 0, "model": "agentrl",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "push " * tokens},
                     "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 100, "completion_tokens": tokens, "total_tokens": 100 + tokens},
    }  # fmt: skip
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=reply)))
    return lambda i, turns: openai.AsyncOpenAI(
        base_url="http://canned/v1", api_key="k", http_client=http, max_retries=0
    )


def _http_clients(base_url: str, key_for):
    """Clients over loopback HTTP, sharing one connection pool."""
    import openai

    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    return lambda i, turns: openai.AsyncOpenAI(
        base_url=base_url, api_key=key_for(i, turns), http_client=http, max_retries=0
    )


async def _agentrl_sides(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from transformers import AutoTokenizer

    from agentrl.config.schema import RolloutConfig, SamplingConfig
    from agentrl.envmanager.chat import ChatTokens
    from agentrl.examples.sokoban_openai_agent import MOVE
    from agentrl.gateway.server import Gateway
    from agentrl.rollout.engine_client import EngineClient
    from agentrl.rollout.fleet import EngineSpec, start_engines, start_router

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engines = start_engines(EngineSpec(RolloutConfig(num_engines=1), model_path))
    router = start_router(engines, RolloutConfig(num_engines=1))
    client = EngineClient(router)
    tok = AutoTokenizer.from_pretrained(model_path)
    chat = ChatTokens(tok, [MOVE])
    sampling = SamplingConfig(max_tokens=args.tokens, ignore_eos=True)
    out: dict[str, Any] = {}
    episode_ids = itertools.count()
    try:
        for agents in args.agents:

            def direct_player(prefix: str, sdk_for: Any = None, agents: int = agents) -> Any:
                """The env manager's direct token path; with `sdk_for`, each turn first makes the SDK agent's call
                (answered by MockTransport): an agent that pays its SDK against an endpoint that costs nothing."""

                async def play(i: int, turns: int) -> None:
                    eid, sdk = f"{prefix}{agents}-{i}-{turns}", sdk_for(i, turns) if sdk_for else None
                    replies: list[str] = []
                    for turn in range(turns):
                        messages = _messages(i, turn, replies)
                        if sdk is not None:
                            await sdk.chat.completions.create(
                                model="agentrl", messages=messages, tools=[MOVE], max_tokens=args.tokens
                            )
                        g = await client.generate(eid, chat.prompt_ids(messages), sampling, f"{eid}-{turn}")
                        replies.append(chat.model_text(g.token_ids))
                    client.release(eid)

                return play

            gw = Gateway(tok, client.generate, max_total_tokens=4096)
            await gw.start()
            sessions: dict[tuple[int, int], Any] = {}
            reused: list[bool] = []

            def key_for(i: int, turns: int, gw: Gateway = gw, sessions: dict = sessions) -> str:
                s = gw.open(f"g{next(episode_ids)}", sampling, max_calls=turns)
                sessions[(i, turns)] = s
                return s.key

            def done(i: int, turns: int, gw: Gateway = gw, sessions: dict = sessions, reused: list = reused) -> None:
                """The episode ends, as AgentEpisodes ends one: its key closed (so no finished transcript stays
                live); every call after the first continued its recorded tokens (one segment)."""
                s = sessions.pop((i, turns))
                reused.append(len(s.transcript.lines) == 1)
                gw.close(s)

            in_process = _sdk_player(
                lambda i, t, gw=gw: gw.client(key_for(i, t), 600), "agentrl", args.tokens, [MOVE], done=done
            )
            over_http = _sdk_player(_http_clients(f"{gw.url}/v1", key_for), "agentrl", args.tokens, [MOVE], done=done)
            canned = _sdk_player(_canned_clients(args.tokens), "agentrl", args.tokens, [MOVE])
            with_sdk = direct_player("s", _canned_clients(args.tokens))
            plays = {"direct": direct_player("d"), "gateway": in_process, "gateway_http": over_http,
                     "agent_sdk_alone": canned, "direct_with_sdk": with_sdk}  # fmt: skip
            out[str(agents)] = await _interleaved(plays, agents, args)
            out[str(agents)]["gateway"]["history_reused"] = bool(reused) and all(reused)
            await gw.stop()
    finally:
        ray.shutdown()
    return out


async def _vllm_serve_side(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.examples.sokoban_openai_agent import MOVE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--port", str(port),
        "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--served-model-name", "tiny", "--block-size", "32",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not start in 300 s")
            await asyncio.sleep(1)
        out = {}
        for agents in args.agents:
            url = f"http://127.0.0.1:{port}/v1"
            clients = _http_clients(url, lambda i, t: "none")
            play = _sdk_player(clients, "tiny", args.tokens, [MOVE], extra={"ignore_eos": True})
            out[str(agents)] = (await _interleaved({"vllm_serve": play}, agents, args))["vllm_serve"]
        return out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


def _paired(ratio, *runs: list[float]) -> float:
    return statistics.median(ratio(*repeat) for repeat in zip(*runs, strict=True))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.models.tiny import resolve_model_path

    model_path = resolve_model_path(args.model)
    ours = await _agentrl_sides(model_path, args)
    served = await _vllm_serve_side(model_path, args)
    result: dict[str, Any] = {
        "agents": args.agents,
        "turns": args.turns,
        "tokens_per_call": args.tokens,
        "by_agents": {},
    }
    for agents in map(str, args.agents):
        runs = {side: ours[agents][side]["cpu_ms_per_call_runs"] for side in ours[agents]}
        d, g, h, v = (runs[k] for k in ("direct", "gateway", "gateway_http", "agent_sdk_alone"))
        served_rate = served[agents]["calls_per_s"]
        result["by_agents"][agents] = {
            **ours[agents],
            "vllm_serve": served[agents],
            # paired: each repeat's sides ran back to back, so each repeat gives one ratio; the median of those
            "overhead": _paired(lambda g, d, v: (g - d - v) / g, g, d, v),
            "overhead_with_sdk": _paired(lambda g, d: (g - d) / g, g, d),
            "overhead_http": _paired(lambda h, d, v: (h - d - v) / h, h, d, v),
            "overhead_vs_direct_with_sdk": _paired(lambda g, ds: (g - ds) / g, g, runs["direct_with_sdk"]),
            "vs_vllm_serve": ours[agents]["gateway"]["calls_per_s"] / served_rate,
            "vs_vllm_serve_http": ours[agents]["gateway_http"]["calls_per_s"] / served_rate,
        }
    result["targets"] = {"overhead_max": 0.10, "vs_vllm_serve_min": 1.0}
    result["load_avg"] = os.getloadavg()
    return result


def main() -> None:
    print(json.dumps(asyncio.run(_run(_args())), indent=1))


if __name__ == "__main__":
    main()
