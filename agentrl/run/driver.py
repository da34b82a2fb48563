"""`agentrl train`'s driver: the run dir, Ray and the run's parts, the loop, and how the run ends (a summary table,
or one line saying how to resume it)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import time
from pathlib import Path

from agentrl.config import Config, ConfigError, dump_yaml
from agentrl.observe.console import RunView, print_summary, run_summary
from agentrl.platform import configure_cpu_threads
from agentrl.run.buffer import RolloutStalled
from agentrl.run.loop import Pipeline
from agentrl.run.parts import start_parts
from agentrl.run.startup import init_ray
from agentrl.run.state import latest_checkpoint


def train(cfg: Config, resume: str | None = None, verbose: bool = False) -> int:
    """Run (or resume) a training run; ends with a summary table (held-out success before and after RL, where
    things are, how to resume). A stop signal or a stalled rollout saves a checkpoint and ends the run with one
    line saying how to resume it. verbose: Ray's start-up notices too."""
    t0 = time.perf_counter()
    configure_cpu_threads(1)
    run_dir = Path(resume or cfg.run_dir).absolute()  # actors get paths from here, whatever their working dir
    new_dir = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    resume_from = latest_checkpoint(run_dir) if (resume or cfg.checkpoint.resume == "auto") else None
    view = RunView(cfg.trainer.total_steps, show=cfg.logging.console)
    try:
        with view.starting(f"Ray, {cfg.rollout.num_engines} rollout engine(s), the trainer, env managers"):
            init_ray(cfg.ray_address, quiet=not verbose)
            parts = start_parts(cfg, run_dir)
            pipeline = Pipeline(cfg, run_dir, parts, view)
    except ConfigError:
        if new_dir:  # a run that never started leaves no folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    resume_hint = f"resume with: agentrl train {run_dir / 'config.yaml'} --resume {run_dir}"
    try:
        result = asyncio.run(pipeline.run(resume_from))
    except RolloutStalled as err:
        print(f"agentrl: stopped at step {pipeline.state.step}: {err}; {resume_hint}", file=sys.stderr)
        return 1
    finally:
        pipeline.close()
        parts.close()
    if pipeline.stop_signal is not None:
        name = signal.Signals(pipeline.stop_signal).name
        print(f"agentrl: {name} at step {pipeline.state.step}: checkpoint saved; {resume_hint}", file=sys.stderr)
        return 128 + pipeline.stop_signal
    print_summary(run_summary(run_dir, result, pipeline.view, time.perf_counter() - t0, cfg.logging.tensorboard))
    return 0
