"""Agent programs as external commands: any language, any framework, configured as `agent: "cmd: ARGV..."`.

The command runs once per episode with `OPENAI_BASE_URL` and `OPENAI_API_KEY` set (the episode's key), so an agent
written for any OpenAI-compatible server runs unchanged; `AGENTRL_TASK` holds the task as JSON (also at
`GET $OPENAI_BASE_URL/agentrl/task`), and `POST $OPENAI_BASE_URL/agentrl/step` with `{"action": text}` acts in the
episode's env. Its reward is its last output line that is JSON (a number, or an object with `reward` and numeric
metrics); without one, the env's return (the rewards its steps got).

It runs in the python tool's jail (agentrl.tools.pyexec: bubblewrap, the same kernel limits, a wall-time limit of
`gateway.agent_timeout_s` after which its whole process tree is killed). Inside, it can reach exactly:

- the network: its own loopback only, where a forwarder started before it listens; the forwarder's only way out is
  the gateway's Unix socket, mounted into the jail. So it reaches its gateway (and, with its key, only its own
  episode) and no other address, on this machine or beyond;
- files: /usr and this Python installation, read-only; the env manager's working directory (the agent's code),
  read-only; a private, size-capped /tmp, its only writable place.

`gateway.command_sandbox: false` drops the jail (keeping the limits and the process-group kill) for runs that already
sit in a disposable container; the command can then reach whatever this machine can.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

PREFIX = "cmd:"

# Runs in the jail (as the python tool's snippet: after the uid drop and limits). The command's output is the
# jail's output; its exit code is the jail's.
_BOOTSTRAP = """\
import os, socket, subprocess, sys, threading
SOCK, ARGV, CWD, ENV = {sock!r}, {argv!r}, {cwd!r}, {env!r}
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(64)

def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

def forward():
    while True:
        outside, _ = listener.accept()
        gateway = socket.socket(socket.AF_UNIX)
        gateway.connect(SOCK)
        threading.Thread(target=pump, args=(outside, gateway), daemon=True).start()
        threading.Thread(target=pump, args=(gateway, outside), daemon=True).start()

threading.Thread(target=forward, daemon=True).start()
env = dict(os.environ, **ENV, OPENAI_BASE_URL="http://127.0.0.1:%d/v1" % listener.getsockname()[1])
sys.stdout.flush()
sys.exit(subprocess.run(ARGV, cwd=CWD, env=env).returncode)
"""


def is_command(agent: str) -> bool:
    return agent.startswith(PREFIX)


def command_argv(agent: str) -> list[str]:
    """The command's argv; `python` / `python3` is this interpreter (the one agentrl and its packages run on)."""
    argv = shlex.split(agent[len(PREFIX) :])
    if not argv:
        raise ValueError(f"agent {agent!r}: no command after {PREFIX!r}")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


@dataclass
class CommandRun:
    output: str
    exit_code: int | None
    timed_out: bool


async def run_command(
    agent: str, socket_path: str, key: str, task: dict[str, Any], timeout_s: float, sandbox: bool = True
) -> CommandRun:
    """Run the agent command for one episode (see the module docstring for what it gets and can reach)."""
    from agentrl.tools.pyexec import SandboxLimits, run_sandboxed

    cwd = os.getcwd()
    env = {
        "OPENAI_API_KEY": key,
        "AGENTRL_TASK": json.dumps(task),
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
    }
    code = _BOOTSTRAP.format(sock=socket_path, argv=command_argv(agent), cwd=cwd, env=env)
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=4096, max_output_bytes=1 << 16, max_processes=128)
    binds = ((cwd, False), (os.path.dirname(socket_path), False))
    out = await run_sandboxed(code, limits, unsafe=not sandbox, binds=binds)
    return CommandRun(out.output, out.exit_code, out.timed_out)


def reward_from_output(output: str) -> float | dict[str, Any] | None:
    """The last output line that is JSON: a number, or an object with `reward`; None when there is none."""
    for line in reversed(output.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, dict) and "reward" in value:
            return value
    return None
