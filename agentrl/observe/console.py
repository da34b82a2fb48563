"""The run's console view: progress with an ETA for the warm start, each validation and the RL steps.

On a terminal (stderr a TTY, not TERM=dumb) a rich live view is refreshed in place: a bar per phase under way and
one for the RL steps, with the step's key numbers (success, return, seconds per step, staleness, idle); a finished
warm start or validation leaves one line above it. Elsewhere (CI, log files) the same news comes as plain lines:
one per RL step, a few per phase (at each quarter), one per result, each cut to the console width (COLUMNS, else
80) by dropping the least important numbers, so no line wraps. It is also the run's console metrics sink
(`log(step, metrics)`), and remembers the held-out results the end-of-run summary reports.
"""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn
from rich.table import Column
from rich.text import Text


def clock(seconds: float | None) -> str:
    """1:02:03, 4:05, or -:-- when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta(elapsed: float | None, done: float, left: float) -> float | None:
    """Seconds left at the average rate so far (None before the first unit is done)."""
    return None if not elapsed or done <= 0 else elapsed / done * max(0.0, left)


def fit(items: list[str], width: int, sep: str = "  ") -> str:
    """The items, in order, for as long as they fit in `width` (the first is cut if it alone does not)."""
    line = items[0] if items else ""
    for item in items[1:]:
        if len(line) + len(sep) + len(item) > width:
            break
        line += sep + item
    return line[:width]


def step_numbers(metrics: Mapping[str, float]) -> list[str]:
    """An RL step's key numbers, most important first."""
    shown = (
        ("episode/success", lambda v: f"success {v:.3f}"),
        ("episode/return", lambda v: f"return {v:.3g}"),
        ("timing/step", lambda v: f"{v:.3g} s/step"),
        ("staleness/mean", lambda v: f"staleness {v:.2g}"),
        ("idle/trainer", lambda v: f"trainer idle {v:.0%}"),
        ("idle/rollout", lambda v: f"rollout idle {v:.0%}"),
        ("train/loss", lambda v: f"loss {v:.3g}"),
        ("throughput/tokens_per_s", lambda v: f"{v:.0f} tok/s"),
    )
    return [show(metrics[key]) for key, show in shown if key in metrics and math.isfinite(metrics[key])]


class _Eta(ProgressColumn):
    """Elapsed time and the time left, from the task's own average rate."""

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text(clock(task.elapsed))
        done = task.completed - task.fields.get("first", 0)
        return Text(f"{clock(task.elapsed)} ETA {clock(eta(task.elapsed, done, (task.total or 0) - task.completed))}")


class _Bars(Progress):
    """rich's progress bars, then a line of the last RL step's numbers: as many as fit the terminal's width."""

    status: tuple[str, ...] = ()

    def get_renderables(self) -> Iterator[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        if self.status:
            yield Text(fit(list(self.status), self.console.width), no_wrap=True, overflow="crop")


class RunView:
    """The live view (a TTY), plain lines (no TTY), or nothing shown (`show=False`: it still remembers the
    held-out results for the summary)."""

    def __init__(self, total_steps: int | None = None, show: bool = True, console: Console | None = None):
        self.total_steps = total_steps
        self.show = show
        self.console = console or Console(stderr=True, highlight=False)
        self.live = show and self.console.is_interactive  # a terminal, not TERM=dumb (TTY_INTERACTIVE=0/1 decides)
        self.val_success: dict[int, float] = {}  # held-out success by step
        self.train_success: dict[int, float] = {}
        self._progress: _Bars | None = None
        self._steps_task: int | None = None
        self._steps_t0 = 0.0
        self._steps_start = 0
        self._last_phase: tuple[int, float] | None = None  # (units, seconds) of the phase that ended last

    # ---- output ----------------------------------------------------------------------------------------------
    def line(self, items: list[str]) -> None:
        """One plain line, as many items as fit the width (above the bars on a TTY)."""
        if self.show:
            self.console.print(Text(fit(items, self.console.width)), no_wrap=True, overflow="crop", crop=True)

    def _bars(self) -> _Bars:
        if self._progress is None:
            cell = {"no_wrap": True, "overflow": "ellipsis"}
            self._progress = _Bars(
                TextColumn("{task.description}", table_column=Column(**cell)),
                BarColumn(bar_width=None, table_column=Column(**cell, ratio=1)),  # the bar takes what is left
                MofNCompleteColumn(table_column=Column(**cell)),
                TextColumn("{task.fields[unit]}", table_column=Column(**cell)),
                _Eta(table_column=Column(**cell)),
                console=self.console,
                refresh_per_second=2,
                expand=True,
            )
            self._progress.start()
        return self._progress

    # ---- phases: start-up, the warm start, a validation ------------------------------------------------------
    @contextmanager
    def starting(self, what: str) -> Iterator[None]:
        """A spinner on a TTY while the run starts, then one line saying how long it took (none if it fails: a
        start-up error stays the one line on stderr)."""
        t0 = time.perf_counter()
        with self.console.status(f"starting {what}") if self.live else nullcontext():
            yield
        self.line([f"started {what} in {clock(time.perf_counter() - t0)}"])

    @contextmanager
    def phase(self, name: str, total: int, unit: str = "") -> Iterator[Callable[[], None]]:
        """A bar for `total` units of work; the block calls the yielded tick() once per unit done (any thread)."""
        t0, done, quarters = time.perf_counter(), 0, 0
        task = self._bars().add_task(name, total=total, unit=unit) if self.live else None

        def tick() -> None:
            nonlocal done, quarters
            done += 1
            if task is not None:
                self._bars().advance(task, 1)
            elif done < total and done * 4 // total > quarters:  # plain: a line at each quarter
                quarters = done * 4 // total
                seconds = time.perf_counter() - t0
                self.line([f"{name}: {done}/{total} {unit}".rstrip(), f"ETA {clock(eta(seconds, done, total - done))}"])

        try:
            yield tick
        finally:
            self._last_phase = (done, time.perf_counter() - t0)
            if task is not None:
                self._bars().remove_task(task)
                self._bars().refresh()

    # ---- RL steps --------------------------------------------------------------------------------------------
    def start_steps(self, done: int) -> None:
        """RL steps start (from `done`, on a resume): the step bar and the ETA's clock."""
        self._steps_t0, self._steps_start = time.perf_counter(), done
        if self.live:
            bars = self._bars()
            self._steps_task = bars.add_task("RL steps", total=self.total_steps, completed=done, first=done, unit="")

    # ---- the metrics sink ------------------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if "sft/seconds" in metrics:
            self._warm_start(metrics)
        elif "timing/step" in metrics or "val/success" not in metrics:  # an RL step (not a validation alone)
            self._step(step, metrics)
        if "val/success" in metrics:
            self._validation(step, metrics)

    def _warm_start(self, m: Mapping[str, float]) -> None:
        if m.get("sft/cached"):
            self.line(["warm start: the cached one (trainer.sft.cache)"])
            return
        items = [f"warm start: {m['sft/samples']:.0f} demo samples", f"SFT {clock(m['sft/seconds'])}"]
        if "train/loss" in m:
            items.append(f"loss {m['train/loss']:.3g}")
        if m.get("sft/failed_episodes"):
            items.append(f"{m['sft/failed_episodes']:.0f} failed demo episodes")
        self.line(items)

    def _step(self, step: int, m: Mapping[str, float]) -> None:
        if "episode/success" in m:
            self.train_success[step] = m["episode/success"]
        numbers = step_numbers(m)
        if self._steps_task is not None:
            bars = self._bars()
            bars.status = (f"step {step}: {numbers[0]}", *numbers[1:]) if numbers else ()
            bars.update(self._steps_task, completed=step)
            bars.refresh()
            return
        if not self.total_steps:  # a sink on its own: no run to time
            self.line([f"step {step}", *numbers])
            return
        seconds = time.perf_counter() - self._steps_t0 if self._steps_t0 else None
        left = eta(seconds, step - self._steps_start, self.total_steps - step)
        self.line([f"step {step}/{self.total_steps}", f"ETA {clock(left)}", *numbers])

    def _validation(self, step: int, m: Mapping[str, float]) -> None:
        self.val_success[step] = m["val/success"]
        tags = [f"{k.split('/')[1]} {v:.3f}" for k, v in m.items() if k.startswith("val/") and k.count("/") == 2
                and k.endswith("/success")]  # fmt: skip
        items = [f"validation at step {step}: success {m['val/success']:.3f}"]
        if self._last_phase is not None:
            items.append(f"{self._last_phase[0]} episodes in {clock(self._last_phase[1])}")
        self.line(items + (tags if len(tags) > 1 else []))

    def best_step(self) -> str:
        """The step with the best held-out success (else training success), as words."""
        for kind, by_step in (("held-out", self.val_success), ("training", self.train_success)):
            if by_step:
                step = max(by_step, key=lambda s: (by_step[s], -s))
                return f"step {step} ({kind} success {by_step[step]:.3f})"
        return "n/a"

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._steps_task = None


def print_summary(rows: list[tuple[str, str]], console: Console | None = None) -> None:
    """The end-of-run table (stdout): names left, values wrapped (never cut) to fit the console width."""
    console = console or Console(highlight=False)
    name_w = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        lines = textwrap.wrap(value, max(20, console.width - name_w), break_on_hyphens=False) or [""]
        for k, text in enumerate(lines):
            console.print(Text.assemble((f"{name if k == 0 else '':<{name_w}}", "bold"), text), crop=True)


def run_summary(
    run_dir: Path, result: Mapping[str, Mapping[str, float]], view: RunView, wall_s: float, tensorboard: bool
) -> list[tuple[str, str]]:
    """Rows of the summary: held-out success before/after, best step, wall time, where things are, resume."""
    from agentrl.observe.metrics import plot_run
    from agentrl.run.state import latest_checkpoint

    first, last = result.get("first", {}), result.get("last", {})
    rows = []
    if "val/success" in last:
        before = f"{first['val/success']:.3f}" if "val/success" in first else "n/a"
        rows.append(("held-out success", f"{before} before RL, {last['val/success']:.3f} after"))
    rows += [("best step", view.best_step()), ("wall time", clock(wall_s)), ("run dir", str(run_dir))]
    checkpoint = latest_checkpoint(run_dir)
    rows.append(("checkpoint", str(checkpoint) if checkpoint else "none"))
    rows.append(("plot", str(plot_run(run_dir))))
    rows.append(("viewer", f"agentrl view {run_dir}"))  # curves, config and episodes in the browser
    if tensorboard:
        rows.append(("TensorBoard", f"tensorboard --logdir {run_dir / 'tensorboard'}"))
    rows.append(("resume", f"agentrl train {run_dir / 'config.yaml'} --resume {run_dir}"))
    return rows
