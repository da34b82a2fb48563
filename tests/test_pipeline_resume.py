"""Kill the training driver (SIGKILL to its whole process group) at random points, including in the middle of a
checkpoint save, then stop it with a SIGTERM (a checkpoint and one line), resuming after each: over the whole
run every admitted task group is trained exactly once. One run covers both: each launch costs a driver, a trainer
and an engine start."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.observe.metrics import read_jsonl
from agentrl.run.state import latest_checkpoint

CONFIG = Path(__file__).parent / "configs" / "tiny_pipeline.yaml"
STEPS = 8
VALIDATING = ("validation.every_steps=1", "validation.episodes_per_tag=4")


def _train(spawn, run_dir: Path, *extra: str, cwd: Path | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "agentrl", "train", str(CONFIG), f"logging.run_dir={run_dir}",
            f"trainer.total_steps={STEPS}", "checkpoint.every_steps=1", "validation.every_steps=0",
            "trainer.sft.enabled=false", "async.max_staleness=1", "async.partial_rollout=true",
            "rollout.stop_after_failed_groups=4", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return spawn(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, ready, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"run exited before {what}:\n{proc.stdout.read().decode()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.005)


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _trained_steps(run_dir: Path) -> int:
    log = run_dir / "trained_groups.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _ledger(run_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """Trained groups (from the log), groups admitted but not trained (from the last checkpoint), and the
    admitted sequence (the schedule up to its cursor)."""
    records = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "each step logged once, in order"
    trained = [g for r in records for g in r["groups"]]
    snapshot = pickle.loads((latest_checkpoint(run_dir) / "pipeline.pkl").read_bytes())
    state = snapshot.state
    assert state.step == STEPS and state.trained == len(trained)
    pending = [f"{t}/{s}" for t, s in [*snapshot.buffer["running"], *state.to_rerun]]
    pending += [f"{g.tag}/{g.seed}" for g in snapshot.buffer["ready"]]
    admitted = ["/".join(map(str, state.schedule.at(i))) for i in range(state.schedule.cursor)]
    return trained, pending, admitted


@pytest.mark.slow
def test_random_kills_and_a_sigterm_lose_nothing_and_train_every_admitted_group_exactly_once(tmp_path, spawn):
    """SIGKILLs at random points, then a SIGTERM, each followed by a resume; the run still ends with every admitted
    group trained exactly once. The SIGTERM stop (periodic checkpoints off for that launch, so its checkpoint is
    the stop's own) exits with one line naming the absolute run dir (the resume before it got a relative one), and
    the resume after it validates the step it starts from, then each next one."""
    rng = random.Random(22)
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    proc = _train(spawn, run_dir, "logging.run_dir=run", cwd=tmp_path)  # relative: the driver makes it absolute
    kills = []
    # Kill points: in the middle of a checkpoint save (its temporary folder exists), then a random moment 0-1.5 s
    # after a step's checkpoint (the producer has moved on, or the next step is under way). A third launch killed
    # 0-0.5 s after a checkpoint was dropped: its moments are a part of the second's, and it cost ~45 s.
    for kind in ("during_save", "after_save"):
        start = latest_checkpoint(run_dir)
        start_step = int(start.name.split("-")[1]) if start else 0
        launched = time.time()

        def stepped(steps: int = start_step, launched: float = launched) -> bool:
            """This process has trained a step (the log is rewritten at start-up, then grows)."""
            log = run_dir / "trained_groups.jsonl"
            return log.exists() and log.stat().st_mtime > launched and _trained_steps(run_dir) > steps

        if kind == "during_save":
            _wait(proc, lambda: any(p.name >= ".step-000002" for p in checkpoints.glob(".step-*.tmp")), "a save")
        else:
            _wait(proc, stepped, "a trained step")
            _wait(proc, lambda s=start_step: latest_checkpoint(run_dir).name > f"step-{s:06d}", "a checkpoint")
            time.sleep(rng.uniform(0.0, 1.5))
        _kill(proc)
        kills.append((kind, _trained_steps(run_dir)))
        assert latest_checkpoint(run_dir) is not None, f"no usable checkpoint after a kill {kind}"
        extra = ("checkpoint.every_steps=0", *VALIDATING) if kind == "after_save" else ()
        proc = _train(spawn, run_dir, *extra, "--resume", "run" if extra else str(run_dir), cwd=tmp_path)
    resumed_from = int(latest_checkpoint(run_dir).name.split("-")[1])
    out = _sigterm_after_a_step(proc, run_dir)
    assert "resuming from step" in out and "groups in flight" in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith("agentrl: SIGTERM at step ") and f"--resume {run_dir}" in lines[-1], lines[-20:]
    assert not any("Traceback" in line or "*** SIG" in line for line in lines), lines
    stopped_at = int(lines[-1].split("at step ")[1].split(":")[0])
    assert stopped_at > resumed_from and latest_checkpoint(run_dir).name == f"step-{stopped_at:06d}"
    assert not list(Path("/dev/shm").glob(f"agentrl-weights-*-{proc.pid}")), "weights folder left behind"
    assert stopped_at < STEPS, f"the SIGTERM came too late to test its resume: step {stopped_at}"

    resumed_at = time.time()
    proc = _train(spawn, run_dir, *VALIDATING, "--resume", str(run_dir))
    out, _ = proc.communicate(timeout=600)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert max(steps for _, steps in kills) < STEPS, f"the kills came too late to test anything: {kills}"
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["time"] > resumed_at]
    validated = [r["step"] for r in rows if "val/success" in r]
    assert validated == list(range(stopped_at, STEPS + 1)), "the resume validates the step it starts from, then each"

    trained, pending, admitted = _ledger(run_dir)
    assert len(trained) == len(set(trained)), f"a group was trained twice: {sorted(trained)}"
    assert not set(trained) & set(pending)
    assert sorted(trained + pending) == sorted(admitted), "a group was lost or came from outside the schedule"
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert rows[-1]["train/version"] == STEPS and rows[-1]["rollout/failed_episodes"] == 0


def _sigterm_after_a_step(proc: subprocess.Popen, run_dir: Path) -> str:
    """SIGTERM once this launch has trained a step; the launch's output (it must exit 128 + SIGTERM)."""
    before, launched = _trained_steps(run_dir), time.time()
    log = run_dir / "trained_groups.jsonl"
    _wait(proc, lambda: log.stat().st_mtime > launched and _trained_steps(run_dir) > before, "a trained step")
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out.decode()[-3000:]
    return out.decode()
