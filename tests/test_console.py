"""`agentrl train`'s console: a live progress view on a terminal, plain lines no wider than the terminal elsewhere."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import sys
import termios
import time

import pytest
from rich.console import Console

from agentrl.observe.console import RunView, fit
from tests.cli_run import ROOT

WIDTH = 72
TINY = ["tests/configs/tiny_pipeline.yaml", "logging.console=true", "trainer.total_steps=2", "checkpoint.every_steps=0",
        "trainer.sft.episodes=8"]  # fmt: skip
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _env(**extra: str) -> dict[str, str]:
    rich = ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")  # what decides rich's view
    env = {k: v for k, v in os.environ.items() if k not in rich}
    return {**env, **extra}


def _train_in_pty(spawn, run_dir: str, width: int) -> tuple[int, str]:
    """`agentrl train` with a pseudo-terminal `width` columns wide as stdin/stdout/stderr; (exit code, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, width, 0, 0))
    proc = spawn(
        [sys.executable, "-m", "agentrl", "train", *TINY, f"logging.run_dir={run_dir}"],
        cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env=_env(TERM="xterm-256color"),
    )  # fmt: skip
    os.close(slave)
    out, deadline = b"", time.monotonic() + 240
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
    finally:
        os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace")


@pytest.mark.slow
def test_progress_view_on_a_terminal(tmp_path, spawn):
    # A tiny run (warm start, validations at steps 0 and 2, two RL steps) in a terminal. The same view without one
    # (plain lines no wider than $COLUMNS) is checked on the run of tests/test_packaging.py's card command.
    code, shown = _train_in_pty(spawn, str(tmp_path / "tty"), WIDTH)

    assert code == 0, shown
    assert "\x1b[" in shown and "━" in shown  # a live, coloured view with bars...
    for words in ("warm start: SFT", "validation at step 0", "RL steps", "2/2", "ETA", "success", "s/step"):
        assert words in shown, words
    screen = ANSI.sub("", shown)
    for segment in re.split(r"[\r\n]+", screen):  # ...redrawn in place: no drawn line wraps the terminal
        assert len(segment) <= WIDTH, segment
    for words in ("started Ray", "validation at step 0: success", "held-out success", "--resume"):
        assert words in screen, words  # lines left above the view, then the summary table
    assert "Token authentication" not in screen


def test_plain_step_lines_keep_the_most_important_numbers_that_fit():
    out = io.StringIO()
    view = RunView(total_steps=60, console=Console(file=out, width=50))
    view.start_steps(0)
    metrics = {"timing/step": 12.34, "episode/success": 0.25, "episode/return": 0.5, "staleness/mean": 0.8,
               "idle/trainer": 0.42, "idle/rollout": 0.1, "train/loss": 0.01}  # fmt: skip
    view.log(3, metrics)
    view.log(4, {**metrics, "val/success": 0.5, "val/a/success": 0.25, "val/b/success": 0.75})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 3/60  ETA ") and "success 0.250  return 0.5" in lines[0]
    assert all(len(line) <= 50 for line in lines) and "staleness" not in lines[0]
    assert lines[2].startswith("validation at step 4: success 0.500")
    assert view.best_step() == "step 4 (held-out success 0.500)"
    assert fit(["x" * 60, "y"], 50) == "x" * 50
