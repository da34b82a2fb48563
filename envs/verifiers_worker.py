"""One verifiers environment, served to agentrl over this process's stdin / stdout (JSON lines).

Run with the python of the verifiers virtualenv (`.venv-verifiers`, made by scripts/setup_venv.sh): verifiers pins
packages agentrl cannot share (mcp below 2), so its environments live in a process of their own, as an OpenEnv
server does. This file imports only the standard library and verifiers' own packages.

    python verifiers_worker.py ENV_ID ENV_ARGS_JSON

verifiers loads ENV_ID as its `load_environment` (a module on the path with `load_environment(**ENV_ARGS)`), then:
- the first line out: {"ready": true, "train": N, "eval": M} (example counts), or {"error": "..."} and exit 1;
- {"id": ID, "op": "example", "split": "train"|"eval", "index": I} -> {"id": ID, "prompt": [...], "answer": ...}
- {"id": ID, "op": "rollout", "split", "index", "base_url", "api_key", "model", "sampling": {...}}
  -> {"id": ID, "reward": R, "metrics": {...}, "error": null or "..."}: verifiers runs the rollout against
  the OpenAI-compatible endpoint (agentrl's gateway, this episode's key) and scores it with the env's rubric.
Requests run concurrently; answers come back in the order they finish. A closed stdin ends the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any


def _out() -> Any:
    """This process's stdout for protocol lines only: whatever the library prints goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


async def _lines(stream: Any) -> Any:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stream)
    while line := await reader.readline():
        yield line


class Worker:
    def __init__(self, env: Any, out: Any):
        self.env, self.out = env, out
        self.data = {"train": env.get_dataset(), "eval": env.get_eval_dataset()}

    def example(self, split: str, index: int) -> dict[str, Any]:
        rows = self.data[split]
        return dict(rows[index % len(rows)])

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        row = self.example(request.get("split", "train"), int(request["index"]))
        if request["op"] == "example":
            return {"prompt": row.get("prompt"), "answer": row.get("answer")}
        if request["op"] != "rollout":
            raise ValueError(f"unknown op {request['op']!r}")
        from openai import AsyncOpenAI
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        http = AsyncOpenAI(base_url=request["base_url"], api_key=request["api_key"], max_retries=0)
        try:
            output = await self.env.run_rollout(
                row, OpenAIChatCompletionsClient(http), request["model"], request.get("sampling") or {}
            )
        finally:
            await http.close()
        error = output.get("error")
        return {
            "reward": float(output.get("reward") or 0.0),
            "metrics": {k: float(v) for k, v in (output.get("metrics") or {}).items() if isinstance(v, int | float)},
            "error": None if error is None else str(error),
        }

    async def serve(self, request: dict[str, Any]) -> None:
        rid = request.get("id")
        try:
            line = json.dumps({"id": rid, **await self.answer(request)})  # a row JSON cannot hold fails here too
        except Exception as err:  # one request's failure is its episode's, never the worker's
            tail = traceback.format_exc().strip().splitlines()[-1]
            line = json.dumps({"id": rid, "error": f"{type(err).__name__}: {err}" if str(err) else tail})
        self.out.write(line + "\n")


async def main() -> None:
    out = _out()
    try:
        import verifiers as vf

        env = vf.load_environment(sys.argv[1], **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
        worker = Worker(env, out)
    except Exception as err:
        out.write(json.dumps({"error": f"verifiers could not load {sys.argv[1:2]}: {type(err).__name__}: {err}"}))
        out.write("\n")
        sys.exit(1)
    out.write(json.dumps({"ready": True, "train": len(worker.data["train"]), "eval": len(worker.data["eval"])}) + "\n")
    running: set[asyncio.Task] = set()
    async for line in _lines(sys.stdin):
        task = asyncio.ensure_future(worker.serve(json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)


if __name__ == "__main__":
    asyncio.run(main())
