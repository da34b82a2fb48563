"""Kill the training driver mid-run (SIGKILL, the whole process group), resume from its run dir: the step and
version sequences continue and no task group is lost or trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentrl.metrics import read_jsonl

CONFIG = Path(__file__).parent / "configs" / "tiny_pipeline.yaml"


def _train(run_dir: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "agentrl", "train", str(CONFIG), f"logging.run_dir={run_dir}",
            "trainer.total_steps=5", "checkpoint.every_steps=1", "validation.every_steps=0",
            "trainer.sft.enabled=false", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_killed_driver_resumes_without_losing_or_repeating_groups(tmp_path):
    run_dir = tmp_path / "run"
    first = _train(run_dir)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and first.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step-000002":
            break
        time.sleep(0.2)
    assert first.poll() is None, first.stdout.read().decode()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = int(latest.read_text().strip().split("-")[1])
    assert 2 <= killed_at < 5
    second = _train(run_dir, "--resume", str(run_dir))
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out.decode()[-3000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    resumed = max(i for i, r in enumerate(rows) if r["step"] == killed_at + 1)
    assert [r["step"] for r in rows[resumed:]] == list(range(killed_at + 1, 6))
    assert [r["train/version"] for r in rows[resumed:]] == list(range(killed_at + 1, 6))  # no SFT: version == step
    # the last record of each step is the one whose update survived: no group trained twice, none missing
    by_step = {}
    for line in (run_dir / "trained_groups.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["groups"]
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    groups = [g for step in sorted(by_step) for g in by_step[step]]
    assert len(groups) == len(set(groups)) == 5 * 2
