"""`verifiers/<env id>`: a verifiers environment (its classic stack: `vf.SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`,
...) trained through the agent gateway.

A verifiers environment drives the model itself: it builds the prompt, calls an OpenAI client, runs its tools and
turns, and scores the rollout with its rubric. So in agentrl it is an agent episode: this env gives the task (row
`seed` of the env's dataset), and the `verifiers` agent has verifiers run that rollout against the episode's
gateway endpoint and key. Every model call is a gateway turn, recorded token-exact; the rubric's reward is the
episode's reward and its metrics the episode's metrics.

verifiers pins packages agentrl cannot share (mcp below 2), so it runs in its own virtualenv (`.venv-verifiers`,
made by `scripts/setup_venv.sh`, or the python in `$AGENTRL_VERIFIERS_PYTHON`): one worker process per
(env id, env_args) and env manager (`verifiers_worker.py`, JSON lines over its pipes), shared by the episodes.
`kwargs`: `env_args` (what verifiers' `load_environment` gets), `split` (`train` or `eval`: the env's
dataset or its eval dataset), `pythonpath` (folders where the env's module is, besides the working directory and
installed packages), `timeout_s` (one rollout).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from agentrl.envs.base import TextEnv

PREFIX = "verifiers/"
PYTHON_VAR = "AGENTRL_VERIFIERS_PYTHON"
DEFAULT_PYTHON = ".venv-verifiers/bin/python"
WORKER = Path(__file__).with_name("verifiers_worker.py")


class VerifiersError(RuntimeError):
    """The verifiers worker could not start or answer (its message says why)."""


def verifiers_python() -> str:
    """$AGENTRL_VERIFIERS_PYTHON, else .venv-verifiers/bin/python here or in agentrl's checkout."""
    given = os.environ.get(PYTHON_VAR)
    checkout = Path(__file__).resolve().parents[1]
    candidates = [Path(given)] if given else [Path(DEFAULT_PYTHON), checkout / DEFAULT_PYTHON]
    for python in candidates:
        if python.exists():
            return str(python)
    raise VerifiersError(
        f"verifiers envs run in their own virtualenv, and {candidates[0]} is missing: `bash scripts/setup_venv.sh` "
        f"makes .venv-verifiers (pinned by constraints-verifiers.txt), or set {PYTHON_VAR} to a python with "
        "verifiers installed"
    )


class Worker:
    """One verifiers worker process: requests by id from any thread, answers read on a thread of its own."""

    def __init__(self, env_id: str, env_args: dict[str, Any], pythonpath: list[str], start_timeout_s: float = 120.0):
        folders = [*pythonpath, os.getcwd(), os.environ.get("PYTHONPATH", "")]
        path = os.pathsep.join(str(Path(p).resolve()) if p else "" for p in folders if p)
        self.proc = subprocess.Popen(
            [verifiers_python(), str(WORKER), env_id, json.dumps(env_args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # verifiers' own logging; failures come back as answers
            text=True,
            env={**os.environ, "PYTHONPATH": path},  # where the user's load_environment modules are
            start_new_session=True,
        )
        self._ids = itertools.count()
        self._waiting: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        first = concurrent.futures.Future()
        self._waiting["ready"] = first
        threading.Thread(target=self._read, daemon=True, name=f"verifiers-{env_id}").start()
        try:
            ready = first.result(timeout=start_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise VerifiersError(f"verifiers env {env_id} did not load in {start_timeout_s:.0f}s") from None
        if "error" in ready:
            self.close()
            raise VerifiersError(ready["error"])
        self.examples = {"train": int(ready["train"]), "eval": int(ready["eval"])}

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:  # a line cut short by the worker's death: its caller learns it below
                continue
            future = self._waiting.pop(str(reply.pop("id", None) or "ready"), None)
            if future is not None and not future.done():
                future.set_result(reply)
        self.proc.stdout.close()
        with contextlib.suppress(subprocess.TimeoutExpired):  # its output closed: it is exiting
            self.proc.wait(timeout=5)
        with self._lock:  # the worker is gone: every caller still waiting learns it now
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(VerifiersError(f"the verifiers worker exited (code {self.proc.poll()})"))

    def submit(self, request: dict[str, Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        rid = f"r{next(self._ids)}"
        with self._lock:
            if self.proc.poll() is not None:
                raise VerifiersError(f"the verifiers worker exited (code {self.proc.returncode})")
            self._waiting[rid] = future
            try:
                self.proc.stdin.write(json.dumps({"id": rid, **request}) + "\n")
                self.proc.stdin.flush()
            except OSError as err:  # it died between the check and the write
                self._waiting.pop(rid, None)
                raise VerifiersError(f"the verifiers worker exited: {err}") from None
        return future

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):  # a pipe the dead worker left half-written
            self.proc.stdin.close()


_WORKERS: dict[str, Worker] = {}
_WORKERS_LOCK = threading.Lock()


def worker_for(env_id: str, env_args: dict[str, Any], pythonpath: list[str]) -> Worker:
    """This process's worker for the env (started on first use, replaced when it died)."""
    key = json.dumps([env_id, env_args, pythonpath], sort_keys=True)
    with _WORKERS_LOCK:
        worker = _WORKERS.get(key)
        if worker is None or worker.proc.poll() is not None:
            if worker is not None:
                worker.close()
            worker = _WORKERS[key] = Worker(env_id, env_args, pythonpath)
        return worker


@atexit.register
def _close_workers() -> None:
    for worker in list(_WORKERS.values()):
        worker.close()


class VerifiersEnv(TextEnv):
    """The task side of a verifiers env: row `seed` of its dataset (the rollout itself is the `verifiers` agent's)."""

    contract = frozenset()  # verifiers envs keep their own rules (prompting, parsing, turn limits)

    def __init__(
        self,
        env: str,
        env_args: dict[str, Any] | None = None,
        split: str = "train",
        pythonpath: list[str] | None = None,
        timeout_s: float = 300.0,
        max_steps: int = 32,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.env, self.env_args, self.split, self.timeout_s = env, dict(env_args or {}), split, float(timeout_s)
        self.pythonpath = [str(Path(p).resolve()) for p in pythonpath or []]
        self.worker = worker_for(env, self.env_args, self.pythonpath)
        self.prompt: list[dict[str, Any]] = []
        self.index = 0

    def system_prompt(self) -> str:
        return next((str(m["content"]) for m in self.prompt if m.get("role") == "system"), "")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        self.index = int(seed or 0) % max(1, self.worker.examples[self.split])
        example = self.worker.submit({"op": "example", "split": self.split, "index": self.index})
        row = example.result(timeout=self.timeout_s)
        if "error" in row:
            raise VerifiersError(row["error"])
        self.prompt = list(row.get("prompt") or [])
        task = {
            "verifiers_env": self.env,
            "env_args": self.env_args,
            "pythonpath": self.pythonpath,
            "split": self.split,
            "index": self.index,
            "timeout_s": self.timeout_s,
            "answer": row.get("answer"),
        }
        users = [str(m.get("content")) for m in self.prompt if m.get("role") == "user"]
        return (users[-1] if users else ""), {"seed": self.index, "task": task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        raise VerifiersError(
            f"{PREFIX}{self.env} is played by verifiers itself (the `verifiers` agent), not stepped by the env manager"
        )


def register_id(env_id: str) -> None:
    """`verifiers/<env id>` names any verifiers env: registered when first named."""
    from agentrl.envs.registry import register_env

    name = env_id[len(PREFIX) :]
    if not name:
        raise ValueError("verifiers/<env id>: name the verifiers environment (its load_environment module)")
    register_env(env_id, f"{__name__}:VerifiersEnv", env=name)


async def verifiers_agent(client: Any, task: Any) -> dict[str, Any]:
    """The agent of every `verifiers/...` env (the default `agent` of its env config): verifiers runs the rollout
    against this episode's gateway endpoint and key; its rubric's reward and metrics are the episode's."""
    import asyncio

    d = task.data
    request = {"op": "rollout", "split": d["split"], "index": d["index"], "base_url": task.base_url,
               "api_key": task.api_key, "model": task.model}  # fmt: skip
    future = worker_for(d["verifiers_env"], d["env_args"], d["pythonpath"]).submit(request)
    reply = await asyncio.wait_for(asyncio.wrap_future(future), d["timeout_s"])
    if reply.get("error"):
        raise VerifiersError(f"verifiers rollout failed: {reply['error']}")
    return {"reward": reply["reward"], **reply.get("metrics", {})}
