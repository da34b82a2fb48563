"""Whole `agentrl` runs that several test files read (a pytest plugin of tests/conftest.py): each is launched once per
test run, and the files using it are one xdist unit (conftest.SHARED_FIXTURES), since a launch costs ~30-60 s here."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.cli_run import ROOT

TOOL_EXAMPLE_WARM_START = ROOT / "tests" / "data" / "math_tools_warm_start"
IN_PROCESS_CALCULATOR = 'tools.sets.calculator.calculator={python: "agentrl.tools.calculator:calculator"}'
TERMINAL_WIDTH = 72  # the terminal the getting-started run draws its live view on
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")  # a terminal's control sequences


def strip_ansi(shown: str) -> str:
    """What a terminal showed, as text: without its colours and cursor moves."""
    return ANSI.sub("", shown)


def _end(proc: subprocess.Popen) -> None:
    """The launch and everything it started (its own session) end here."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="session")
def tool_example_run(tmp_path_factory) -> tuple[Path, str]:
    """(run dir, stdout) of one `agentrl train examples/math_tools.yaml` (the calculator in-process), 12 RL steps
    from the example's recorded warm start, validated at steps 0, 6 and 12 on 128 episodes a tag, with episodes
    logged and batches saved every step: the learning guard reads its learning, the viewer's tests what a user sees
    of it."""
    run_dir = tmp_path_factory.mktemp("tool_example") / "run"
    args = [sys.executable, "-m", "agentrl", "train", str(ROOT / "examples" / "math_tools.yaml"),
            IN_PROCESS_CALCULATOR,
            f"model.path={TOOL_EXAMPLE_WARM_START}", "trainer.sft.enabled=false", "trainer.total_steps=12", "seed=0",
            "validation.every_steps=6", "validation.episodes_per_tag=128", "checkpoint.every_steps=0",
            "logging.sample_every_steps=1", "logging.save_batches=true", "logging.console=false",
            f"logging.run_dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        _end(proc)
    assert proc.returncode == 0, err[-3000:]
    return run_dir, out


def getting_started_files() -> list[tuple[str, str]]:
    """(file name, text) of each file docs/getting-started.md has the reader write."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    return re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', page, re.S)


@pytest.fixture(scope="session")
def getting_started_run(tmp_path_factory) -> tuple[Path, int, str]:
    """(folder, exit code, what the terminal showed) of the getting-started page's `agentrl train walk.yaml --import
    walk_env`, in the folder holding the files the page writes, shortened to 2 RL steps, on a pseudo-terminal
    TERMINAL_WIDTH columns wide as a user's shell gives it: the docs' test checks the run, the console's its live
    view."""
    folder = tmp_path_factory.mktemp("getting_started")
    for name, body in getting_started_files():
        (folder / name).write_text(body)
    short = ["trainer.total_steps=2", "trainer.sft.episodes=64", "trainer.sft.steps=10", "validation.every_steps=2",
             "validation.episodes_per_tag=4", "logging.sample_every_steps=1"]  # fmt: skip
    args = [sys.executable, "-m", "agentrl", "train", "walk.yaml", "--import", "walk_env", *short]
    code, shown = run_in_terminal(args, folder, TERMINAL_WIDTH)
    return folder, code, shown


def run_in_terminal(args: list[str], cwd: Path, width: int, timeout_s: float = 300) -> tuple[int, str]:
    """`args` with a pseudo-terminal `width` columns wide as stdin/stdout/stderr, and rich's own environment
    variables unset (the terminal decides its view); (exit code, output)."""
    rich = ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {**{k: v for k, v in os.environ.items() if k not in rich}, "TERM": "xterm-256color"}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, width, 0, 0))
    proc = subprocess.Popen(args, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout_s
    try:  # read until the driver has exited and the terminal is drained (Ray's daemons may keep it open)
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                out += os.read(master, 65536)
            except OSError:  # EIO: every process closed the terminal
                break
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
        _end(proc)
    return code, out.decode(errors="replace")
