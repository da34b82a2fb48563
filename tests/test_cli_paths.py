"""`agentrl export` and `agentrl eval --checkpoint` take a run dir, a step dir or its trainer/, or a HF model dir.

A real checkpoint: one in-process trainer rank on CPU (its own gloo group), saved by `save_run_state` exactly as a
run lays it out (RUN/checkpoints/step-000001/trainer, pipeline.pkl, latest).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.cli import build_parser, main, rollout_cmd
from agentrl.run.checkpoint_paths import CheckpointPathError, hf_dir_for_eval, resolve_model_source
from agentrl.run.state import RunState, Snapshot, TaskSchedule, save_run_state
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "tests" / "configs" / "tiny_pipeline.yaml")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_path) -> Path:
    import torch.distributed as dist

    from agentrl.config.schema import Config
    from agentrl.trainer import worker as W

    assert not dist.is_initialized()
    run = tmp_path_factory.mktemp("run") / "agentic_tiny"
    rank = W.TrainerRank(Config().model_dump(by_alias=True), tiny_model_path, 0, 1)
    rank.setup("127.0.0.1", free_port())
    try:
        state = RunState(TaskSchedule(["t"], {"t": 0}, {"t": 1}), step=1)
        save_run_state(run, Snapshot(state, {"ready": []}), rank, keep_last=2)
    finally:
        rank.shutdown()
    return run


def test_resolver_accepts_run_step_trainer_and_hf_dirs(run_dir: Path, tiny_model_path: str) -> None:
    trainer = run_dir / "checkpoints" / "step-000001" / "trainer"
    for path in (run_dir, run_dir / "checkpoints", trainer.parent, trainer):
        source = resolve_model_source(path)
        assert (source.kind, source.path) == ("trainer", trainer), path
    hf = resolve_model_source(tiny_model_path)
    assert (hf.kind, hf.path) == ("hf", Path(tiny_model_path))
    assert hf_dir_for_eval(hf) == Path(tiny_model_path)


def test_resolver_rejects_other_dirs_in_one_line(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a config without weights is no model dir
    for path in (tmp_path, run_dir / "checkpoints" / "step-000001" / "trainer" / "hf", tmp_path / "missing"):
        with pytest.raises(CheckpointPathError) as err:
            resolve_model_source(path)
        msg = str(err.value)
        assert "\n" not in msg and "run dir" in msg and "step dir" in msg and "Hugging Face model dir" in msg
    empty_run = tmp_path / "run"
    (empty_run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointPathError, match="no complete checkpoint"):
        resolve_model_source(empty_run)


def test_export_a_step_dir_end_to_end(run_dir: Path, tmp_path: Path, tiny_model_path: str) -> None:
    out = tmp_path / "out"
    step = run_dir / "checkpoints" / "step-000001"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl", "export", str(step), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert resolve_model_source(out).kind == "hf"

    # An HF dir, or no checkpoint at all: one line, exit 2 (in-process: the same `main`).
    assert main(["export", tiny_model_path, str(tmp_path / "x")]) == 2
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 2


def test_eval_options_and_overrides_in_any_order(run_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    parser = build_parser()
    for argv in (
        ["eval", CONFIG, "--checkpoint", "D", "validation.episodes_per_tag=2"],
        ["eval", "--checkpoint", "D", CONFIG, "validation.episodes_per_tag=2"],
        ["eval", CONFIG, "validation.episodes_per_tag=2", "--checkpoint", "D"],
    ):
        args = parser.parse_args(argv)
        assert (args.config, args.checkpoint, args.overrides) == (CONFIG, "D", ["validation.episodes_per_tag=2"])

    # A wrong --checkpoint after an override: one line naming the accepted forms, before any engine starts.
    assert main(["eval", CONFIG, "--checkpoint", str(tmp_path), "validation.episodes_per_tag=2"]) == 2
    assert "Hugging Face model dir" in capsys.readouterr().err

    # A run dir: its latest checkpoint is exported next to itself and the engines get that HF dir.
    import agentrl.envmanager.manager as manager

    seen: dict = {}

    async def fake_evaluate(cfg, managers):
        seen["episodes"] = cfg.validation.episodes_per_tag
        return manager.Evaluation({"val/success": 0.5}, [])

    def fake_fleet(cfg, model_path, ref=None):
        seen["path"] = model_path
        return []

    monkeypatch.setattr(rollout_cmd, "_fleet", fake_fleet)
    monkeypatch.setattr(manager, "evaluate", fake_evaluate)
    assert main(["eval", CONFIG, "--checkpoint", str(run_dir), "validation.episodes_per_tag=2"]) == 0
    exported = run_dir / "checkpoints" / "step-000001" / "trainer-hf"
    assert seen == {"path": str(exported), "episodes": 2}
    assert resolve_model_source(exported).kind == "hf"
    assert "val/success: 0.5000" in capsys.readouterr().out
    made = (exported / "model.safetensors").stat().st_mtime_ns
    assert hf_dir_for_eval(resolve_model_source(run_dir)) == exported  # reused, not exported again
    assert (exported / "model.safetensors").stat().st_mtime_ns == made
    shutil.rmtree(exported)
