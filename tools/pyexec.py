"""Built-in `python`: run a snippet in a sandboxed subprocess and return what it printed.

The sandbox is a fresh interpreter in isolated mode (`-I`: no PYTHON* variables, no user site, no script dir
on sys.path), a fresh temporary working directory, an environment holding nothing inherited (so no API keys or
tokens leak in), and kernel limits set inside the child before the snippet runs: address space (memory),
CPU seconds, file size, open files. The parent enforces wall time (killing the whole process group) and caps
the output it reads. This bounds accidents and runaway model code; it is not a jail against a determined
attacker (there is no network or filesystem namespace): run tool servers that execute code in a container.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

from agentrl.tools.core import Tool

# Runs first in the child: limits are set on both soft and hard values, so the snippet cannot raise them back.
_LAUNCHER = """\
import resource, runpy, sys
mem, cpu, fsize = {mem}, {cpu}, {fsize}
for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(what, (value, value))
    except (ValueError, OSError):
        pass
sys.argv = ["snippet.py"]
runpy.run_path("snippet.py", run_name="__main__")
"""


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_mb: int = 16


@dataclass
class RunOutput:
    output: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False


def _clean_env(home: str) -> dict[str, str]:
    """Nothing inherited: only what an interpreter needs to run and print UTF-8."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


async def run_sandboxed(code: str, limits: SandboxLimits | None = None) -> RunOutput:
    """Run `code` under the limits; stdout and stderr come back interleaved, capped at max_output_bytes."""
    lim = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="agentrl-py-") as workdir:
        with open(os.path.join(workdir, "snippet.py"), "w", encoding="utf-8") as f:
            f.write(code)
        launcher = _LAUNCHER.format(mem=lim.memory_mb << 20, cpu=int(lim.timeout_s) + 1, fsize=lim.max_file_mb << 20)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            launcher,
            cwd=workdir,
            env=_clean_env(workdir),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills every child it forked too
        )
        chunks: list[bytes] = []
        size = 0
        truncated = timed_out = False

        async def read_all() -> None:
            nonlocal size, truncated
            assert proc.stdout is not None
            while True:
                chunk = await proc.stdout.read(65536)
                if not chunk:
                    return
                if size + len(chunk) > lim.max_output_bytes:
                    chunks.append(chunk[: lim.max_output_bytes - size])
                    size = lim.max_output_bytes
                    truncated = True
                    _kill(proc)  # no point letting it print gigabytes nobody reads
                    return
                chunks.append(chunk)
                size += len(chunk)

        try:
            await asyncio.wait_for(read_all(), lim.timeout_s)
            await asyncio.wait_for(proc.wait(), max(0.5, lim.timeout_s))
        except TimeoutError:
            timed_out = True
        finally:
            _kill(proc)
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                pass
        text = b"".join(chunks).decode("utf-8", errors="replace")
        return RunOutput(text, proc.returncode, timed_out=timed_out, truncated=truncated)


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _describe(out: RunOutput, lim: SandboxLimits) -> str:
    text = out.output
    if out.truncated:
        text += f"\n[output truncated at {lim.max_output_bytes} bytes; process stopped]"
    if out.timed_out:
        text += f"\n[stopped: wall-time limit of {lim.timeout_s:g}s exceeded]"
    elif out.exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not out.truncated:  # RLIMIT_CPU
        text += "\n[stopped: CPU-time limit exceeded]"
    elif out.exit_code and not out.truncated:
        if "MemoryError" in out.output:
            text += f"\n[memory limit of {lim.memory_mb} MiB exceeded]"
        text += f"\n[exit code {out.exit_code}]"
    return text.strip() or "(no output; use print() to show results)"


def make_python_tool(
    timeout_s: float = 10.0, memory_mb: int = 512, max_output_bytes: int = 16_384, name: str = "python"
) -> Tool:
    """A `python` tool with its own limits (the built-in uses the defaults)."""
    lim = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)

    async def python(code: str) -> str:
        """Run a Python 3 program in a fresh sandboxed interpreter and return what it prints.

        Args:
            code: a complete program; print() the values you want to see. No network, no state between calls.
        """
        return _describe(await run_sandboxed(code, lim), lim)

    # the server enforces its own per-call timeout as well; give the sandbox time to report first
    return Tool(python, name=name, timeout_s=timeout_s + 5.0)


python = make_python_tool()
