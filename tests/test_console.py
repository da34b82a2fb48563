"""`agentrl train`'s console: a live progress view on a terminal, plain lines no wider than the terminal elsewhere."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from agentrl.observe.console import RunView, fit
from tests.shared_runs import TERMINAL_WIDTH, strip_ansi


@pytest.mark.slow
def test_progress_view_on_a_terminal(getting_started_run):
    # The getting-started page's run (warm start, validations at steps 0 and 2, two RL steps; tests/shared_runs.py)
    # in a terminal. The same view without one (plain lines no wider than $COLUMNS) is checked on the run of
    # tests/test_packaging.py's card command.
    _, code, shown = getting_started_run

    assert code == 0, shown
    assert "\x1b[" in shown and "━" in shown  # a live, coloured view with bars...
    for words in ("warm start: SFT", "validation at step 0", "RL steps", "2/2", "ETA", "success", "s/step"):
        assert words in shown, words
    screen = strip_ansi(shown)
    for segment in re.split(r"[\r\n]+", screen):  # ...redrawn in place: no drawn line wraps the terminal
        assert len(segment) <= TERMINAL_WIDTH, segment
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
