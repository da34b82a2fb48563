"""Typed config: YAML + overrides, and every mistake named by its full key path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.config import Config, ConfigError, dump_yaml, load_config

EXAMPLE = Path(__file__).parents[1] / "examples" / "agentic_sokoban.yaml"


def test_defaults_validate_and_example_loads():
    cfg = load_config()
    assert cfg.rollout.backend == "vllm" and cfg.async_.max_staleness == 0
    example = load_config(EXAMPLE)
    assert example.envs.train["sokoban"].env_id == "agentrl/SimpleSokoban-v0"
    assert example.async_.partial_rollout is True
    # validation plays the prompts training sees: the same env settings (revisit marks included)
    assert example.envs.val["sokoban"].kwargs == example.envs.train["sokoban"].kwargs == {"mark_revisits": True}


@pytest.mark.parametrize("name", ["agentic_sokoban", "sokoban_sync", "math_tools", "sokoban_cluster", "sokoban_npu"])
def test_every_example_run_config_validates(name):
    """The shipped examples: valid keys, registered envs, tool sets that exist, the mode each one names."""
    from agentrl.envmanager.manager import check_turn_limits
    from agentrl.envs import registered_env_ids

    cfg = load_config(EXAMPLE.parent / f"{name}.yaml")
    check_turn_limits(cfg)
    assert {s.env_id for s in [*cfg.envs.train.values(), *cfg.envs.val.values()]} <= set(registered_env_ids())
    assert cfg.name == name
    if name == "sokoban_sync":
        assert cfg.async_.max_staleness == 0 and cfg.envs.sample_mode == "trajectory"
    if name == "math_tools":
        assert cfg.tools.sets["calculator"]["calculator"].url and cfg.envs.train["math"].tools == ["calculator"]
    if name == "sokoban_cluster":
        assert cfg.ray_address == "auto" and cfg.trainer.num_ranks > 1


def test_typed_overrides_scalars_lists_and_nested():
    cfg = load_config(
        EXAMPLE,
        [
            "trainer.total_steps=3",
            "trainer.optim.lr=1e-3",
            "rollout.sampling.stop_token_ids=[5, 7]",
            "async.partial_rollout=false",
            "+envs.train.sokoban.kwargs.dim=[8, 8]",
            "+envs.train.extra={env_id: agentrl/FrozenLake-v0}",
        ],
    )
    assert cfg.trainer.total_steps == 3
    assert cfg.trainer.optim.lr == pytest.approx(1e-3)
    assert cfg.rollout.sampling.stop_token_ids == [5, 7]
    assert cfg.async_.partial_rollout is False
    assert cfg.envs.train["sokoban"].kwargs == {"mark_revisits": True, "dim": [8, 8]}  # added beside the example's
    assert cfg.envs.train["extra"].env_id == "agentrl/FrozenLake-v0"


def test_list_index_override():
    cfg = load_config(None, ["reward.functions=[{name: exact_match}]", "reward.functions.0.weight=0.5"])
    assert cfg.reward.functions[0].weight == 0.5


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.totl_steps=3", "trainer.totl_steps: unknown key (allowed: backend, num_ranks, total_steps"),
        ("trainer.total_steps=abc", "trainer.total_steps: Input should be a valid integer"),
        ("trainer.total_steps=0", "trainer.total_steps: Input should be greater than 0"),
        ("rollout.backend=tpu", "rollout.backend: Input should be 'vllm', 'sglang' or 'remote'"),
        ("envs.train.nope.max_turns=2", "use +envs.train.nope=... to add"),
        ("+trainer.foo=1", "trainer.foo: unknown key"),
        ("+trainer.total_steps=1", "already exists"),
        ("trainer", "expected key=value"),
        ("reward.functions.3.weight=1", "no list item 3"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, [override])
    assert expected in str(err.value)


def test_bad_yaml_keys_and_cross_section_checks(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  optim:\n    lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"trainer\.optim\.lrr: unknown key \(allowed: lr,"):
        load_config(bad)
    bad.write_text("envs:\n  train:\n    s: {env_id: x, tools: [calc]}\n")
    with pytest.raises(ConfigError, match="unknown tool set 'calc'"):
        load_config(bad)
    bad.write_text("tools:\n  sets:\n    calc:\n      c: {python: a:b, url: http://x}\n")
    with pytest.raises(ConfigError, match=r"tools\.sets\.calc\.c: a tool needs exactly one of"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_each_setting_has_one_home(tmp_path):
    """Settings that used to live in two places, or could not apply, are errors that say where they live."""
    from agentrl.envmanager.manager import check_turn_limits

    bad = tmp_path / "bad.yaml"
    bad.write_text("envs:\n  max_tokens_per_turn: 12\n")
    with pytest.raises(ConfigError, match=r"envs: max_tokens_per_turn moved to rollout\.sampling\.max_tokens"):
        load_config(bad)
    bad.write_text("envs:\n  val:\n    s: {env_id: agentrl/SimpleSokoban-v0, group_size: 4}\n")
    with pytest.raises(ConfigError, match=r"envs\.val\.s\.group_size: unknown key"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"envs\.train\.sokoban\.max_turns: 20 exceeds the env's max_steps \(15\)"):
        check_turn_limits(load_config(None, ["envs.train.sokoban.max_turns=20"]))
    check_turn_limits(load_config(None, ["envs.train.sokoban.max_turns=20", "+envs.train.sokoban.kwargs.max_steps=20"]))


def test_validation_sampling_changes_only_what_it_sets():
    cfg = load_config(EXAMPLE, ["rollout.sampling.max_tokens=9", "rollout.sampling.top_p=0.9"])
    val = cfg.rollout.sampling_for("val")
    assert (val.max_tokens, val.top_p, val.temperature) == (9, 0.9, 0.0)
    assert cfg.rollout.sampling_for("train") == cfg.rollout.sampling
    cfg = load_config(EXAMPLE, ["rollout.val_sampling.temperature=0.5", "rollout.val_sampling.max_tokens=4"])
    assert (cfg.rollout.sampling_for("val").temperature, cfg.rollout.sampling_for("val").max_tokens) == (0.5, 4)


def test_dump_round_trips():
    cfg = load_config(EXAMPLE, ["trainer.total_steps=7"])
    again = load_config(None, [])
    data = yaml.safe_load(dump_yaml(cfg))
    assert data["async"]["max_staleness"] == cfg.async_.max_staleness
    assert type(again).model_validate(data) == cfg


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl", *args], capture_output=True, text=True, timeout=120)


def test_cli_config_show_and_errors():
    ok = _cli("config", "show", str(EXAMPLE), "trainer.total_steps=3")
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["trainer"]["total_steps"] == 3
    for bad in ("trainer.totl_steps=3", "trainer.total_steps=abc"):
        res = _cli("config", "show", str(EXAMPLE), bad)
        assert res.returncode == 2
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
        assert bad.split("=")[0] in res.stderr


def test_cli_help_lists_commands():
    res = _cli("--help")
    assert res.returncode == 0
    for command in ("train", "config", "make-model"):
        assert command in res.stdout


RUN_CONFIGS = [*EXAMPLE.parent.glob("*.yaml"), *(Path(__file__).parent / "configs").glob("*.yaml")]


@pytest.mark.parametrize("path", sorted(p for p in RUN_CONFIGS if p.name != "tools.yaml"))  # that one: serve-tools
def test_shipped_run_configs_pass_config_show(path):
    """Examples with a hub id, a cluster address or a remote tool server still validate on a laptop."""
    res = _cli("config", "show", str(path))
    assert res.returncode == 0, res.stderr


def test_env_ids_and_train_envs_are_checked_on_load(tmp_path):
    with pytest.raises(
        ConfigError, match=r"envs\.val\.v\.env_id: unknown env id 'nope/Env-v0' \(registered: .*--import"
    ):
        load_config(EXAMPLE, ["+envs.val.v={env_id: nope/Env-v0}"])
    with pytest.raises(ConfigError, match=r"envs: train is empty"):
        load_config(EXAMPLE, ["envs.train={}"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("envs:\n  train: {}\n")
    with pytest.raises(ConfigError, match=r"envs: train is empty"):
        load_config(bad)


def test_model_path_rules(tmp_path, monkeypatch):
    """builtin:tiny, a local HF dir (config.json), or a hub id; what looks local must exist."""
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ConfigError, match=r"model\.path: .* is not a Hugging Face model directory \(no config\.json\)"):
        load_config(None, [f"model.path={model}"])
    (model / "config.json").write_text("{}")
    assert load_config(None, [f"model.path={model}"]).model.path == str(model)
    monkeypatch.chdir(tmp_path)
    load_config(None, ["model.path=model", "model.path=./model"])  # relative, existing: local
    for path in ("./missing", "../missing", "~/surely-missing-agentrl-model", str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match=r"model\.path: .*missing.* does not exist"):
            load_config(None, [f"model.path={path}"])
    with pytest.raises(ConfigError, match=r"model\.tokenizer: .* \(no tokenizer_config\.json\)"):
        load_config(None, [f"model.tokenizer={model}"])
    load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"])  # a hub id: checked at start-up when online
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=r"model\.path: 'Qwen/Qwen2.5-0.5B-Instruct' is no local directory"):
        load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"])


def test_model_that_cannot_load_is_one_line(tmp_path):
    from agentrl.config import check_model_loads

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model\.path: cannot load") as err:
        check_model_loads(str(tmp_path))
    assert "\n" not in str(err.value)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 3\n  optim: {lr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value).startswith(f"{bad}:4:1: invalid YAML: ") and "\n" not in str(err.value)


def test_unset_learning_rates_follow_the_model(tmp_path) -> None:
    """The tiny model's learning rates (3e-4 RL, 1e-3 SFT) would wreck a pretrained LLM in a few steps: unset,
    they follow model.path, also when an override changes the model; a set one stays."""
    tiny = load_config(None, [])
    assert (tiny.trainer.optim.lr, tiny.trainer.sft.lr) == (3e-4, 1e-3)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    real = load_config(None, [f"model.path={model}"])
    assert (real.trainer.optim.lr, real.trainer.sft.lr) == (1e-6, 1e-5)
    kept = load_config(None, [f"model.path={model}", "trainer.optim.lr=2e-6"])
    assert (kept.trainer.optim.lr, kept.trainer.sft.lr) == (2e-6, 1e-5)
    again = Config.model_validate(real.model_dump(by_alias=True))  # what a trainer rank receives
    assert again.trainer.optim.lr == 1e-6


def test_an_episode_cap_beyond_the_engines_context_is_refused():
    with pytest.raises(ValueError, match=r"envs.max_total_tokens \(8192\) exceeds rollout.max_model_len \(4096\)"):
        Config.model_validate({"envs": {"max_total_tokens": 8192}})
    Config.model_validate({"envs": {"max_total_tokens": 8192}, "rollout": {"max_model_len": 8192}})
    remote = {"backend": "remote", "url": "http://x"}  # a remote server has its own context length
    Config.model_validate({"envs": {"max_total_tokens": 8192}, "rollout": remote})


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("envs.step_timeout_s=3", "envs.step_timeout_s moved to envs.call_timeout_s"),
        ("envs.step_history_window=1", "envs.step_history_window moved to envs.turn_history_window"),
        ("envs.sample_mode=step", "sample_mode: step is now sample_mode: turn"),
        ("trainer.algorithm.advantage=step_return", "advantage: step_return is now advantage: turn_return"),
    ],
)
def test_renamed_keys_and_values_say_where_they_went(override, says):
    """'turn' is the env's and the model's word, 'step' the trainer's: the old names are one line each."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, [override])
