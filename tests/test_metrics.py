"""Metrics sink fans one log call out to JSONL and TensorBoard."""

from __future__ import annotations

from agentrl.observe.console import RunView
from agentrl.observe.metrics import MetricsSink, read_jsonl


def test_jsonl_and_tensorboard(tmp_path):
    sink = MetricsSink(tmp_path, console=RunView(), jsonl=True, tensorboard=True)
    sink.log(1, {"train/loss": 0.5, "episode/success": 0.25, "note": "ignored", "flag": True})
    sink.log(2, {"train/loss": 0.25, "bad": float("nan")})
    sink.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/loss"] == 0.5 and rows[0]["flag"] == 1.0 and "note" not in rows[0]
    assert rows[1]["bad"] is None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [0.5, 0.25]


def test_plot_command_writes_png(tmp_path):
    import subprocess
    import sys

    sink = MetricsSink(tmp_path, jsonl=True, tensorboard=False)
    for step in range(1, 4):
        sink.log(step, {"val/success": 0.1 * step, "episode/success": 0.2, "idle/trainer": 0.05})
    sink.close()
    res = subprocess.run([sys.executable, "-m", "agentrl", "plot", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
