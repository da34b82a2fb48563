"""Built-in `python`: run a snippet in a sandboxed subprocess and return what it printed.

Why a jail: the snippet is model-written code on the machine that runs the tool server. Drills found an unjailed
snippet reading the server's bearer token from /proc/<parent>/environ, reading /etc/shadow, writing
anywhere, reaching 127.0.0.1, and leaving setsid() children running after the call.

So every call runs a fresh interpreter (`-I`) under bubblewrap (`bwrap`, Debian package `bubblewrap`):

- own pid, network, ipc, uts and cgroup namespaces: it sees only its own processes and has no network (its
  loopback is its own, so nothing on the host's 127.0.0.1 either);
- a new root holding only /usr (with the /bin, /lib symlinks) and this Python installation, read-only (no /etc,
  no home, no project), plus a private, size-capped tmpfs /tmp holding its empty working directory;
- an environment holding nothing inherited (bwrap itself is started with the same clean environment);
- kernel limits set before the snippet runs: address space, CPU seconds, file size, open files, process count;
- one lifetime: the launcher is pid 1 of the namespace and dies with bwrap (`--die-with-parent`); the kernel kills
  every process of a pid namespace whose init exits, and the call returns only after that, at the wall-time limit
  (bwrap killed) and on a normal exit alike.

The process-count limit (RLIMIT_NPROC) is counted per user and waived for root. A server running as root therefore
starts bwrap without a user namespace and the launcher drops to a fresh random uid (and so all capabilities) before
the snippet runs; any other user gets a user namespace of its own, where the count covers only this sandbox.

Where bwrap is missing or cannot create namespaces (checked once per process), the tool refuses to run and says
how to fix it. Only where the whole server already sits in a disposable container or VM, configure the unsafe
variant instead: `python: agentrl.tools.pyexec:python_unsafe` (or `make_python_tool(unsafe=True)`), which keeps
the limits, the clean environment and a fresh temporary directory but no jail.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from agentrl.tools.core import Tool

BWRAP = "bwrap"  # name or path of the bubblewrap binary (tests point it elsewhere)
WORKDIR = "/tmp/.sandbox"  # the snippet's empty working directory, on the sandbox's private /tmp

# Runs first in the child: the snippet comes on stdin (no size limit from argv); limits are set on both soft and
# hard values, so the snippet cannot raise them back. In the sandbox the launcher is pid 1 (`--as-pid-1`, so that
# bwrap returns only once the whole namespace is gone) and forks the snippet's process: pid 1 keeps its
# parent-death signal, which the kernel clears on a uid change, and a snippet run as pid 1 would ignore signals.
_LAUNCHER = """\
import os, resource, runpy, sys
code = sys.stdin.buffer.read()
if {as_init}:
    pid = os.fork()
    if pid:
        status = os.waitpid(pid, 0)[1]
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
uid = {uid}
if uid is not None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
for what, value in ((resource.RLIMIT_AS, {mem}), (resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_FSIZE, {fsize}),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, {nproc})):
    try:
        if value is not None:
            resource.setrlimit(what, (value, value))
    except (ValueError, OSError):
        pass
with open("snippet.py", "wb") as f:
    f.write(code)
sys.argv = ["snippet.py"]
runpy.run_path("snippet.py", run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot isolate here; the message names the fix."""


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_mb: int = 16
    max_processes: int = 32  # threads count too
    tmp_mb: int = 64  # the sandbox's whole writable space (tmpfs, held in memory)


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


def _python_dirs() -> list[str]:
    """The directories this interpreter runs from (a venv and the installation it points to)."""
    real_home = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, real_home}
    dirs |= {os.path.realpath(d) for d in dirs}
    return sorted(d for d in dirs if d != "/usr" and not d.startswith("/usr/"))


def _bwrap_argv(bwrap: str, as_root: bool, tmp_bytes: int, binds: tuple[tuple[str, bool], ...] = ()) -> list[str]:
    """The jail; `binds` adds (host path, writable) mounts at the same paths (an agent command's code, its socket)."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    if as_root:  # no user namespace; the launcher needs these two to drop to its fresh uid, which clears them
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--hostname", "sandbox"]
    for key, value in _clean_env(WORKDIR).items():
        argv += ["--setenv", key, value]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged /usr: symlinks into /usr
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    # /tmp first: the Python installation may live under /tmp (a CI clone) and is then bound on top of it
    argv += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    made: set[str] = {"/tmp"}
    mounts = [(path, False) for path in _python_dirs()] + list(binds)
    for path, writable in mounts:
        parent = os.path.dirname(path)
        ancestors = []
        while parent not in ("/", "") and parent not in made:
            ancestors.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(ancestors):  # bwrap would copy the host's modes (/root is 0700); the dropped uid must pass
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
        argv += ["--bind" if writable else "--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--dir", WORKDIR]
    return [*argv, "--chdir", WORKDIR]


def _launcher(lim: SandboxLimits, uid: int | None, nproc: int | None, as_init: bool = True) -> str:
    cpu, mem, fsize = int(lim.timeout_s) + 1, lim.memory_mb << 20, lim.max_file_mb << 20
    return _LAUNCHER.format(as_init=as_init, uid=uid, mem=mem, cpu=cpu, fsize=fsize, nproc=nproc)


def sandbox_problem() -> str | None:
    """Why the sandbox cannot run here, as the one line a user sees (None when it can)."""
    reason = _probe(BWRAP, os.geteuid() == 0)
    if reason is None:
        return None
    return (
        f"python sandbox unavailable ({reason}): install bubblewrap (apt-get install bubblewrap), or, only "
        "where the server is already in a disposable container, configure agentrl.tools.pyexec:python_unsafe"
    )


@functools.cache
def _probe(bwrap: str, as_root: bool) -> str | None:
    """Why the sandbox cannot run here, or None when it can: one real, empty run."""
    path = shutil.which(bwrap)
    if path is None:
        return f"{bwrap} not found"
    uid = (1 << 30) if as_root else None
    argv = [*_bwrap_argv(path, as_root, 1 << 20), sys.executable, "-I", "-c", _launcher(SandboxLimits(), uid, 32)]
    try:
        r = subprocess.run(argv, input=b"", capture_output=True, env=_clean_env("/tmp"), timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{path}: {err}"
    if r.returncode != 0:
        lines = (r.stdout + r.stderr).decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"{path} exited with {r.returncode}"
    return None


async def run_sandboxed(
    code: str, limits: SandboxLimits | None = None, unsafe: bool = False, binds: tuple[tuple[str, bool], ...] = ()
) -> RunOutput:
    """Run `code` under the limits; stdout and stderr come back interleaved, capped at max_output_bytes. `binds`:
    (host path, writable) mounted into the jail at the same paths."""
    lim = limits or SandboxLimits()
    if unsafe:
        with tempfile.TemporaryDirectory(prefix="agentrl-py-") as workdir:
            argv = [sys.executable, "-I", "-c", _launcher(lim, None, None, as_init=False)]
            return await _run(argv, code, lim, workdir, _clean_env(workdir))
    as_root = os.geteuid() == 0
    problem = await asyncio.to_thread(sandbox_problem)
    if problem is not None:
        raise SandboxUnavailable(problem)
    uid = (1 << 30) + secrets.randbelow(1 << 30) if as_root else None  # fresh per call: its own process count
    bwrap = shutil.which(BWRAP) or BWRAP
    info_r, info_w = os.pipe()  # bwrap reports the host pid of the namespace's init here
    try:
        jail = _bwrap_argv(bwrap, as_root, lim.tmp_mb << 20, binds)
        argv = [*jail, "--info-fd", str(info_w), sys.executable, "-I", "-c"]
        argv.append(_launcher(lim, uid, lim.max_processes))
        return await _run(argv, code, lim, None, _clean_env("/tmp"), pass_fds=(info_w,), info_fd=info_r)
    finally:
        os.close(info_r)
        os.close(info_w)


async def _run(
    argv: list[str],
    code: str,
    lim: SandboxLimits,
    cwd: str | None,
    env: dict[str, str],
    pass_fds: tuple[int, ...] = (),
    info_fd: int | None = None,
) -> RunOutput:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout kills every child it forked too
        pass_fds=pass_fds,
    )
    output = _Output(proc, lim.max_output_bytes)
    timed_out = False
    feeder = asyncio.create_task(_feed(proc, code))
    try:
        await asyncio.wait_for(output.read_all(), lim.timeout_s)
        await asyncio.wait_for(proc.wait(), max(0.5, lim.timeout_s))
    except TimeoutError:
        timed_out = True
    finally:
        feeder.cancel()
        killed = _kill(proc) or output.truncated
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
            await asyncio.wait_for(_drain(proc.stdout), 1)  # to EOF, so the pipe transport closes (no leak)
        except TimeoutError:
            pass
        if killed and info_fd is not None:
            await _wait_for_init(info_fd)
    text = b"".join(output.chunks).decode("utf-8", errors="replace")
    return RunOutput(text, proc.returncode, timed_out=timed_out, truncated=output.truncated)


async def _feed(proc: asyncio.subprocess.Process, code: str) -> None:
    """The snippet to the process's stdin, then EOF."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(code.encode("utf-8", errors="replace"))
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # it died before reading everything; the output says why
        pass


class _Output:
    """A process's output, kept up to `max_bytes` (the process is killed once it prints more)."""

    def __init__(self, proc: asyncio.subprocess.Process, max_bytes: int) -> None:
        self.proc, self.max_bytes = proc, max_bytes
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    async def read_all(self) -> None:
        assert self.proc.stdout is not None
        # to EOF even after truncating: asyncio reports the exit only once the pipe has closed, and a pipe left
        # full is never seen to close (the call would then sit out the whole wall-time limit)
        while chunk := await self.proc.stdout.read(65536):
            if self.truncated:
                continue
            if self.size + len(chunk) > self.max_bytes:
                self.chunks.append(chunk[: self.max_bytes - self.size])
                self.size = self.max_bytes
                self.truncated = True
                _kill(self.proc)  # no point letting it print gigabytes nobody reads
                continue
            self.chunks.append(chunk)
            self.size += len(chunk)


async def _drain(stream: asyncio.StreamReader | None) -> None:
    while stream is not None and await stream.read(65536):
        pass


def _kill(proc: asyncio.subprocess.Process) -> bool:
    """SIGKILL its process group, unless it has already exited. True when it was running."""
    if proc.returncode is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return True


async def _wait_for_init(info_fd: int, timeout_s: float = 2.0) -> None:
    """After killing bwrap: wait until the sandbox's init has exited, which the kernel completes only once every
    other process of its pid namespace is dead (its parent-death signal started that; this closes the gap)."""
    os.set_blocking(info_fd, False)
    try:
        pid = json.loads(os.read(info_fd, 4096))["child-pid"]
        pidfd = os.pidfd_open(pid)  # only waited on, never signalled: a reused pid costs a wait, nothing more
    except (OSError, ValueError, KeyError):  # bwrap had not started it, or it is gone already
        return
    try:
        await asyncio.to_thread(select.select, [pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)


# killed by RLIMIT_CPU: the signal itself (no sandbox) or 128 + signal (bwrap's report of it)
_KILLED = {-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL}


def _describe(out: RunOutput, lim: SandboxLimits) -> str:
    text = out.output
    if out.truncated:
        text += f"\n[output truncated at {lim.max_output_bytes} bytes; process stopped]"
    if out.timed_out:
        text += f"\n[stopped: wall-time limit of {lim.timeout_s:g}s exceeded]"
    elif out.exit_code in _KILLED and not out.truncated:  # RLIMIT_CPU
        text += "\n[stopped: CPU-time limit exceeded]"
    elif out.exit_code and not out.truncated:
        if "MemoryError" in out.output:
            text += f"\n[memory limit of {lim.memory_mb} MiB exceeded]"
        text += f"\n[exit code {out.exit_code}]"
    return text.strip() or "(no output; use print() to show results)"


def make_python_tool(
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_output_bytes: int = 16_384,
    name: str = "python",
    unsafe: bool = False,
) -> Tool:
    """A `python` tool with its own limits (the built-in uses the defaults); `unsafe` drops the jail (see top)."""
    lim = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)

    async def python(code: str) -> str:
        """Run a Python 3 program in a fresh sandboxed interpreter and return what it prints.

        Args:
            code: a complete program; print() the values you want to see. No network, no state between calls.
        """
        return _describe(await run_sandboxed(code, lim, unsafe=unsafe), lim)

    # the server enforces its own per-call timeout as well; give the sandbox time to report first
    tool = Tool(python, name=name, timeout_s=timeout_s + 5.0)
    tool.check = None if unsafe else sandbox_problem
    return tool


python = make_python_tool()
python_unsafe = make_python_tool(unsafe=True)
