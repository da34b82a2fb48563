"""One `log(step, metrics)` that fans out to the console (agentrl.console), a JSONL file, TensorBoard and optional
trackers.

Metric names are a contract that tests and benchmarks read: `timing/...`, `throughput/...`, `idle/...`, etc.
Optional trackers (wandb, mlflow, swanlab) are imported only when configured.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
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

    def close(self) -> None:
        self._writer.close()


class TrackerBackend:
    """wandb / mlflow / swanlab, imported lazily; a missing package is a clear error at start-up."""

    def __init__(self, name: str, project: str, run_name: str, config: dict[str, Any]):
        self.name = name
        try:
            if name == "wandb":
                import wandb as mod

                self._run = mod.init(project=project, name=run_name, config=config)
            elif name == "swanlab":
                import swanlab as mod

                self._run = mod.init(project=project, experiment_name=run_name, config=config)
            elif name == "mlflow":
                import mlflow as mod

                mod.set_experiment(project)
                self._run = mod.start_run(run_name=run_name)
                mod.log_params({k: str(v)[:250] for k, v in config.items()})
            else:
                raise ValueError(f"unknown tracker {name!r}")
        except ImportError as err:
            raise RuntimeError(
                f"logging.trackers has {name!r} but it is not installed: pip install agentrl[tracking]"
            ) from err
        self._mod = mod

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.name == "mlflow":
            self._mod.log_metrics({k.replace("/", "."): v for k, v in metrics.items()}, step=step)
        else:
            self._mod.log(dict(metrics), step=step)

    def close(self) -> None:
        if self.name == "mlflow":
            self._mod.end_run()
        else:
            self._mod.finish()


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        console: bool | MetricsBackend = True,
        jsonl: bool = True,
        tensorboard: bool = True,
        trackers: list[str] | tuple[str, ...] = (),
        project: str = "agentrl",
        run_name: str = "run",
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.backends: list[MetricsBackend] = []
        if jsonl:
            self.backends.append(JsonlBackend(self.run_dir / "metrics.jsonl"))
        if tensorboard:
            self.backends.append(TensorBoardBackend(self.run_dir / "tensorboard"))
        if console is True:
            from agentrl.console import RunView

            console = RunView()
        if console:  # the run's view (agentrl.console): live progress on a TTY, plain lines elsewhere
            self.backends.append(console)
        for name in trackers:
            self.backends.append(TrackerBackend(name, project, run_name, config or {}))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numeric.update({k: float(v) for k, v in metrics.items() if isinstance(v, bool)})
        for backend in self.backends:
            backend.log(step, numeric)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
