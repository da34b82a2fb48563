"""logging.trackers with the real libraries, written locally and read back from disk with each library's own formats.

MetricsSink is driven directly (no training run). wandb writes an offline run (RUN_DIR/wandb/offline-run-*/run-ID.wandb,
a LevelDB-style log of wandb's own protobuf Records) that is read back record by record; MLflow a file store
(RUN_DIR/mlruns) read back through MlflowClient; SwanLab an offline run (RUN_DIR/swanlog/run-*) read back with its
own DataStoreReader.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from agentrl.config import ConfigError
from agentrl.config.schema import Config, LoggingConfig
from agentrl.observe.metrics import MetricsSink, flatten_config

STEPS = {
    1: {"episode/return": 0.5, "val/success": 0.25, "timing/step_s": 1.5},
    2: {"episode/return": 1.0, "val/success": 0.5, "timing/step_s": 1.25},
    3: {"episode/return": 1.5, "throughput/tokens_per_s": 1000.0},
}


# One line of RUN_DIR/episodes (agentrl.run.episode_log), as the loop hands it to the trackers.
EPISODE = {
    "step": 2, "phase": "train", "picked": "best", "episode_id": "train/math/3/1", "tag": "math", "env_id": "m",
    "episode_return": 1.0, "success": 1.0, "truncation": None,
    "messages": [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "<answer>4</answer>", "turn": 0}],
    "turns": [{"token_ids": [5, 6], "versions": [1, 1], "reward": 1.0, "done": True}],
}  # fmt: skip


def _run_config() -> dict:
    return Config(name="tracked", seed=7).model_dump(mode="json", by_alias=True)


def _write_run(run_dir: Path, trackers: list[str]) -> dict:
    config = _run_config()
    sink = MetricsSink(
        run_dir, tensorboard=False, trackers=trackers, project="agentrl-test", run_name="tracked",
        config=config,
    )  # fmt: skip
    for step, metrics in STEPS.items():
        sink.log(step, {**metrics, "note": "not a number"})
        if step == 2:
            sink.log_episodes(2, "train", [EPISODE])
    sink.close()
    assert (run_dir / "curves.png").is_file()  # the plot the trackers got
    return flatten_config(config)


def _wandb_records(path: Path) -> list:
    """The Records of a .wandb file: a 7-byte header (':W&B', 0xBEE1, version), then 32 KiB blocks of chunks, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending, payloads = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            payloads.append(pending)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """wandb's own config/cache dirs in tmp_path, and no WANDB_MODE from the environment (offline is the default)."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def test_wandb_offline_run_has_config_metrics_and_plot(tmp_path, wandb_home):
    run_dir = tmp_path / "run"
    flat = _write_run(run_dir, ["wandb"])
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    records = _wandb_records(next(offline.glob("run-*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[0] == "header" and "exit" in kinds  # closed cleanly: the exit record is written by finish()

    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.project, run.display_name) == ("agentrl-test", "tracked")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    for key in ("seed", "name", "trainer.optim.lr", "trainer.optim.betas", "logging.project", "rollout.num_engines"):
        assert config[key] == flat[key], key
    assert not any(isinstance(v, dict) and v for k, v in config.items() if k != "_wandb")  # flat

    rows: dict[int, dict] = {}
    for r in records:
        if r.HasField("history"):
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    assert sorted(rows) == [1, 2, 3]
    for step, metrics in STEPS.items():
        for name, value in metrics.items():
            assert rows[step][name] == pytest.approx(value), (step, name)
        assert "note" not in rows[step]
    image = rows[3]["plot/path"]  # the plot, logged at the last step as an image
    assert rows[3]["plot/_type"] == "image-file"
    assert (offline / "files" / image).is_file() and (offline / "files" / image).read_bytes()[:4] == b"\x89PNG"
    (table,) = (offline / "files" / "media" / "table" / "episodes").glob("train_2_*.table.json")
    data = json.loads(table.read_text())  # the logged episodes as a table at their step
    assert data["columns"][:4] == ["phase", "tag", "picked", "episode"] and data["data"][0][3] == "train/math/3/1"


def _expected_history() -> dict[str, dict[int, float]]:
    names = {k for m in STEPS.values() for k in m}
    return {name: {s: m[name] for s, m in STEPS.items() if name in m} for name in names}


def test_mlflow_file_store_run_has_config_metrics_and_plot(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    flat = _write_run(run_dir, ["mlflow"])
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17 reads a file store only when told to
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("agentrl-test").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    params = run.data.params
    assert len(params) == len(flat)
    for key in ("seed", "name", "trainer.optim.lr", "trainer.optim.betas", "logging.project", "rollout.num_engines"):
        assert params[key] == (flat[key] if isinstance(flat[key], str) else json.dumps(flat[key])), key
    for name, want in _expected_history().items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert got == pytest.approx(want), name
    assert "note" not in run.data.metrics
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curves.png", "episodes"]
    table = client.download_artifacts(run.info.run_id, "episodes/step-000002-train.json", str(tmp_path / "dl"))
    table_data = json.loads(Path(table).read_text())
    assert table_data["columns"][3] == "episode" and table_data["data"][0][3] == "train/math/3/1"
    png = client.download_artifacts(run.info.run_id, "curves.png", str(tmp_path / "download"))
    assert Path(png).read_bytes()[:4] == b"\x89PNG"


def test_swanlab_offline_run_has_config_metrics_and_plot(tmp_path, monkeypatch):
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    run_dir = tmp_path / "run"
    flat = _write_run(run_dir, ["swanlab"])
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (swan_run,) = (run_dir / "swanlog").glob("run-*")
    reader = DataStoreReader()
    reader.open(next(swan_run.glob("run-*.swanlab")))
    records = []
    while (raw := reader.scan()) is not None:
        record = Record()
        record.ParseFromString(raw)
        records.append(record)
    kinds = {r.WhichOneof("record_type") for r in records}
    assert {"start", "finish"} <= kinds  # opened and closed
    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r.HasField("scalar"):
            history.setdefault(r.scalar.key, {})[r.scalar.step] = r.scalar.value.number
    assert history == {name: pytest.approx(want) for name, want in _expected_history().items()}
    config = yaml.safe_load((swan_run / "files" / "config.yaml").read_text())
    for key in ("seed", "name", "trainer.optim.lr", "trainer.optim.betas", "logging.project"):
        assert config[key]["value"] == flat[key], key
    (text,) = (swan_run / "media" / "text").glob("*.txt")  # the logged episode, as markdown
    assert "train/math/3/1" in text.read_text() and "<answer>4</answer>" in text.read_text()
    (png,) = (swan_run / "media" / "image").glob("*.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_tensorboard_in_trackers_turns_on_the_tensorboard_backend(tmp_path):
    assert LoggingConfig(trackers=["tensorboard"], tensorboard=True).tensorboard
    cfg = LoggingConfig.model_validate({"tensorboard": True, "trackers": ["tensorboard"]})
    assert cfg.tensorboard and cfg.trackers == []
    with pytest.raises(ValueError, match="tensorboard is false"):
        LoggingConfig.model_validate({"tensorboard": False, "trackers": ["tensorboard"]})
    assert "tensorboard" in LoggingConfig.model_fields["trackers"].description

    sink = MetricsSink(tmp_path, jsonl=False, tensorboard=False, trackers=["tensorboard"])
    sink.log(1, {"val/success": 0.5})
    sink.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("val/success")] == [0.5]


@pytest.mark.parametrize("name", ["wandb", "mlflow", "swanlab"])
def test_missing_tracker_package_is_a_one_line_config_error(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError, installed or not
    with pytest.raises(ConfigError, match=rf"lists '{name}' .* not installed: pip install 'agentrl\[tracking\]'$"):
        MetricsSink(tmp_path, jsonl=True, tensorboard=False, trackers=[name])


def test_flatten_config_joins_keys_with_dots():
    flat = flatten_config({"a": {"b": 1, "c": {"d": [1, 2]}, "e": {}}, "f": None})
    assert flat == {"a.b": 1, "a.c.d": [1, 2], "a.e": {}, "f": None}
