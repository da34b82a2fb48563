"""A run's metrics: one `log(step, metrics)` that fans out to the run's view (agentrl.observe.console), a JSONL file,
TensorBoard and optional trackers; `read_jsonl` and `plot_run` read the file back.

Metric names are a contract that tests and benchmarks read: `timing/...`, `throughput/...`, `idle/...`, etc.
Optional trackers (wandb, mlflow, swanlab) are imported only when configured and write locally by default
(TrackerBackend).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol


class MetricsBackend(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlBackend:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_episodes(self, step: int, phase: str, episodes: list[dict[str, Any]]) -> None:
        """One text summary per env tag (TensorBoard renders it as markdown)."""
        for tag in dict.fromkeys(e["tag"] for e in episodes):
            text = "\n\n---\n\n".join(episode_markdown(e) for e in episodes if e["tag"] == tag)
            self._writer.add_text(f"episodes/{phase}/{tag}", text, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> one level, keys joined by '.' (`trainer.lr`); an empty mapping stays a value."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """`name=value` in os.environ while the block runs (unless already set), as it was afterwards."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


_TRACKER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}


class TrackerBackend:
    """wandb / mlflow / swanlab, imported lazily; a missing package is a one-line config error at start-up.

    Each writes locally under the run dir unless the library's own environment variable says otherwise:
    - wandb: offline run in RUN_DIR/wandb (WANDB_MODE=online syncs to the cloud);
    - MLflow: file store RUN_DIR/mlruns (MLFLOW_TRACKING_URI points it at a server); MLflow 3 opens a file store only
      with MLFLOW_ALLOW_FILE_STORE=true, so `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns`;
    - SwanLab: offline run in RUN_DIR/swanlog (SWANLAB_MODE=online uploads).
    The flat config is the run's config/params, every metric keeps its agentrl name, and close(plot) attaches the
    run's curves PNG (an image in wandb/SwanLab, an artifact in MLflow) before ending the run."""

    def __init__(self, name: str, project: str, run_name: str, config: Mapping[str, Any], run_dir: Path):
        if name not in _TRACKER_PACKAGES:
            raise ValueError(f"unknown tracker {name!r} (known: {', '.join(_TRACKER_PACKAGES)})")
        self.name = name
        self._last_step = 0
        try:
            mod = importlib.import_module(_TRACKER_PACKAGES[name])
        except ImportError as err:
            from agentrl.config.errors import ConfigError

            raise ConfigError(
                f"logging.trackers lists {name!r} but the {name} package is not installed: "
                "pip install 'agentrl[tracking]'"
            ) from err
        self._mod = mod
        flat = flatten_config(config)
        run_dir.mkdir(parents=True, exist_ok=True)
        if name == "wandb":
            self._run = mod.init(
                project=project,
                name=run_name,
                config=flat,
                dir=str(run_dir),
                mode=None if os.environ.get("WANDB_MODE") else "offline",
                settings=mod.Settings(console="off", silent=True),
            )
        elif name == "swanlab":
            self._run = mod.init(
                project=project,
                experiment_name=run_name,
                config=flat,
                logdir=str(run_dir / "swanlog"),
                mode=None if os.environ.get("SWANLAB_MODE") else "offline",
            )
        else:
            from mlflow.entities import Param

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if uri:
                self._client = mod.MlflowClient(tracking_uri=uri)
            else:  # MLflow 3.x keeps its file store behind an opt-in (its sqlite default needs the full server)
                with _env("MLFLOW_ALLOW_FILE_STORE", "true"):
                    self._client = mod.MlflowClient(tracking_uri=(run_dir / "mlruns").absolute().as_uri())
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
            self._run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000]) for k, v in flat.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self._client.log_batch(self._run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._last_step = max(self._last_step, step)
        if self.name == "mlflow":
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [Metric(k, v, now, step) for k, v in metrics.items()]
            for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a batch
                self._client.log_batch(self._run_id, metrics=batch[i : i + 1000])
        else:
            self._run.log(dict(metrics), step=step)

    def log_episodes(self, step: int, phase: str, episodes: list[dict[str, Any]]) -> None:
        """The episodes as a table (wandb Table, MLflow table artifact) or texts (SwanLab), at `step`."""
        columns = ["phase", "tag", "picked", "episode", "return", "success", "turns", "conversation"]
        rows = [
            [phase, e["tag"], e["picked"], e["episode_id"], e["episode_return"], e["success"], len(e["turns"]),
             episode_markdown(e)]
            for e in episodes
        ]  # fmt: skip
        key = f"episodes/{phase}"
        if self.name == "mlflow":
            data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
            self._client.log_table(self._run_id, data=data, artifact_file=f"episodes/step-{step:06d}-{phase}.json")
        elif self.name == "wandb":
            self._run.log({key: self._mod.Table(columns=columns, data=rows)}, step=max(step, self._last_step))
        else:
            texts = [self._mod.Text(row[-1], caption=f"{row[1]} {row[2]} {row[3]}") for row in rows]
            self._run.log({key: texts}, step=step)
        self._last_step = max(self._last_step, step)

    def close(self, plot: Path | None = None) -> None:
        try:
            if plot is not None and plot.exists():
                if self.name == "mlflow":
                    self._client.log_artifact(self._run_id, str(plot))
                else:  # at the last step: wandb drops a log for a step below one it has seen
                    self._run.log({"plot": self._mod.Image(str(plot))}, step=self._last_step)
        finally:
            if self.name == "mlflow":
                self._client.set_terminated(self._run_id)
            else:
                self._run.finish()
            if self.name == "wandb" and self._mod.run is None:
                # finish() can return before wandb-core has written the run's .wandb file past its header; stopping
                # the service (none of our runs is left) flushes it, so the run on disk is whole when close() returns
                self._mod.teardown()


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        console: MetricsBackend | None = None,
        jsonl: bool = True,
        tensorboard: bool = True,
        trackers: list[str] | tuple[str, ...] = (),
        project: str = "agentrl",
        run_name: str = "run",
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.backends: list[MetricsBackend] = []
        self.trackers: list[TrackerBackend] = []
        self._jsonl = jsonl
        tensorboard = tensorboard or "tensorboard" in trackers  # listed there, it turns the TensorBoard backend on
        if jsonl:
            self.backends.append(JsonlBackend(self.run_dir / "metrics.jsonl"))
        if tensorboard:
            self.backends.append(TensorBoardBackend(self.run_dir / "tensorboard"))
        if console is not None:  # the run view (agentrl.observe.console): progress on a TTY, plain lines elsewhere
            self.backends.append(console)
        try:
            for name in dict.fromkeys(trackers):
                if name != "tensorboard":
                    self.trackers.append(TrackerBackend(name, project, run_name, config or {}, self.run_dir))
        except BaseException:
            self.close(plot=False)
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numeric.update({k: float(v) for k, v in metrics.items() if isinstance(v, bool)})
        for backend in [*self.backends, *self.trackers]:
            backend.log(step, numeric)

    def log_episodes(self, step: int, phase: str, episodes: list[dict[str, Any]]) -> None:
        """A few episodes (RUN_DIR/episodes lines, `agentrl.run.episode_log`) to TensorBoard and the trackers;
        a tracker that fails here is reported and skipped: the episodes file is the record."""
        for backend in [*self.backends, *self.trackers]:
            if hasattr(backend, "log_episodes"):
                try:
                    backend.log_episodes(step, phase, episodes)
                except Exception as err:
                    print(f"agentrl: episodes not sent to {type(backend).__name__}: {err}", file=sys.stderr)

    def close(self, plot: bool = True) -> None:
        """Closes every backend; with trackers and the JSONL file, the run's plot (plot_run) goes to each
        tracker first."""
        for backend in self.backends:
            backend.close()
        self.backends = []
        png = None
        if plot and self.trackers and self._jsonl:
            try:
                png = plot_run(self.run_dir)
            except Exception as err:  # a plot that fails must not keep the trackers' runs open
                print(f"agentrl: no plot for the trackers: {err}", file=sys.stderr)
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(png)


def episode_markdown(episode: Mapping[str, Any]) -> str:
    """An episodes-file line as markdown: a header line, then each message (observations as code blocks, since
    envs render grids as monospaced text)."""
    head = f"**{episode['episode_id']}** ({episode['picked']}): return {episode['episode_return']:.3f}" + (
        f", success {episode['success']:g}" if episode.get("success") is not None else ""
    )
    parts = [head]
    for m in episode["messages"]:
        body = str(m.get("content") or "")
        calls = m.get("tool_calls")
        if calls:
            body += "\n" + "\n".join(f"call: {json.dumps(c)}" for c in calls)
        parts.append(f"*{m.get('role')}*\n```\n{body}\n```")
    return "\n\n".join(parts)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


PANELS = [
    ("held-out success", ["val/success"]),
    ("training success", ["episode/success"]),
    ("episode return", ["episode/return"]),
    ("tokens/s", ["throughput/tokens_per_s"]),
    ("idle fraction", ["idle/trainer", "idle/rollout"]),
    ("staleness", ["staleness/mean", "staleness/max"]),
]


def plot_run(run_dir: str | Path) -> Path:
    """`agentrl plot RUN_DIR`: PNG curves of a run's metrics.jsonl (success, return, throughput, idle, staleness)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
