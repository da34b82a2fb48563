"""Bad input fails before start-up in one line (exit 2), and user code and env faults reach / stay in the actors.

CLI cases run the real `agentrl` as a subprocess: the exit code and the number of stderr lines are the contract.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentrl.config import Config, ConfigError, load_config
from agentrl.envs import register_env
from agentrl.envs.sokoban.env import SokobanEnv
from agentrl.observe.metrics import read_jsonl
from tests.cli_run import agentrl, assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "agentic_sokoban.yaml"

# A user module that registers an env (any entry point will do: what matters is who imported the module).
USER_ENVS = 'import agentrl\nagentrl.register_env("user/Mine-v0", "agentrl.envs.frozen_lake:FrozenLakeEnv")\n'


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("envs.train.sokoban.env_id=agentrl/NoSuch-v0", ["envs.train.sokoban.env_id", "unknown env id", "--import"]),
        ("model.path=/no/such/model", ["model.path", "/no/such/model", "does not exist"]),
        ("model.path=./no_such_model", ["model.path", "does not exist"]),
        ("model.path=builtin:huge", ["model.path", "unknown builtin model"]),
        ("envs.train={}", ["envs", "train is empty"]),
    ],
)
def test_bad_config_fails_train_and_config_show_in_one_line(override: str, words: list[str]) -> None:
    for command in (["config", "show"], ["train"]):
        assert_one_line_error(agentrl(*command, str(EXAMPLE), override), *words)


def test_yaml_syntax_error_is_one_line_with_file_line_col(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 3\n   lr: [1, 2\n")
    res = agentrl("train", str(bad))
    assert_one_line_error(res, f"{bad}:3:", "invalid YAML")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: invalid YAML: "):
        load_config(bad)


def test_options_anywhere_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "user_envs.py").write_text(USER_ENVS)
    add = "+envs.train.mine={env_id: user/Mine-v0}"
    for args in (
        [str(EXAMPLE), "--import", "user_envs", add, "seed=5"],
        ["--import", "user_envs", str(EXAMPLE), add, "seed=5"],
        [str(EXAMPLE), add, "--import", "user_envs", "seed=5"],
    ):
        res = agentrl("config", "show", *args, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        shown = yaml.safe_load(res.stdout)
        assert shown["seed"] == 5 and shown["envs"]["train"]["mine"]["env_id"] == "user/Mine-v0"
    from agentrl.cli import build_parser

    args = build_parser().parse_args(["train", "cfg.yaml", "a.b=1", "--resume", "DIR", "c.d=2"])
    assert (args.config, args.overrides, args.resume) == ("cfg.yaml", ["a.b=1", "c.d=2"], "DIR")


def test_user_env_unknown_without_its_import(tmp_path: Path) -> None:
    (tmp_path / "user_envs.py").write_text(USER_ENVS)
    res = agentrl("config", "show", str(EXAMPLE), "+envs.train.mine={env_id: user/Mine-v0}", cwd=tmp_path)
    assert_one_line_error(res, "user/Mine-v0", "--import")


def test_options_are_never_abbreviated(tmp_path: Path) -> None:
    assert_one_line_error(agentrl("envs", "--jso"), "unrecognized arguments: --jso")
    tools = tmp_path / "tools.yaml"
    tools.write_text("sets: {}\n")
    assert_one_line_error(agentrl("serve-tools", str(tools), "--token", "X"), "unrecognized arguments: --token")


def test_ray_runtime_env_carries_imports_their_source_and_the_collective_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What every Ray worker gets, on any node: the module names, the source of those that are not installed
    (`py_modules`: the driver's working directory need not exist on another node) and the driver's NCCL_* /
    GLOO_* / HCCL_* / ASCEND_* settings, never its visible devices or install locations."""
    from agentrl.plugins import ray_runtime_env

    (tmp_path / "my_envs.py").write_text("")
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "tools.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AGENTRL_IMPORTS", "my_envs,my_pkg.tools,agentrl.envs,json")
    for name, value in {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "TORCH_NCCL_BLOCKING_WAIT": "1",
                        "HCCL_CONNECT_TIMEOUT": "600", "ASCEND_GLOBAL_LOG_LEVEL": "1", "ASCEND_HOME_PATH": "/opt/a",
                        "ASCEND_RT_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "3"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    env = ray_runtime_env()
    assert env["env_vars"]["AGENTRL_IMPORTS"] == "my_envs,my_pkg.tools,agentrl.envs,json"
    assert env["py_modules"] == [str(tmp_path / "my_envs.py"), str(tmp_path / "my_pkg")]  # not agentrl, not json
    forwarded = {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "TORCH_NCCL_BLOCKING_WAIT": "1",
                 "HCCL_CONNECT_TIMEOUT": "600", "ASCEND_GLOBAL_LOG_LEVEL": "1"}  # fmt: skip
    assert forwarded.items() <= env["env_vars"].items()
    kept_back = {"ASCEND_HOME_PATH", "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"}
    assert not kept_back & set(env["env_vars"])
    assert env["worker_process_setup_hook"] == "agentrl.plugins.load_user_modules"


ACTOR_SCRIPT = """
import importlib
import ray
from agentrl.config import ConfigError, load_config
from agentrl.envmanager.manager import check_envs_in_actor
from agentrl.plugins import import_user_modules, ray_runtime_env

import_user_modules(["user_envs"])  # what the CLI does for --import user_envs
ray.init(num_cpus=1, runtime_env=ray_runtime_env(), include_dashboard=False, log_to_driver=False,
         configure_logging=False)
check_envs_in_actor(load_config(None, ["+envs.train.mine={env_id: user/Mine-v0}"]))
print("OK user/Mine-v0")
importlib.import_module("late_envs")  # the driver knows it, the workers were never told to import it
for override in ["+envs.val.late={env_id: user/Late-v0}", "+envs.train.sokoban.kwargs.bogus=1",
                 "envs.train.sokoban.agent=no_such_pkg:agent"]:
    try:
        check_envs_in_actor(load_config(None, [override]))
        print("NO ERROR")
    except ConfigError as err:
        print("ERROR", err)
"""


@pytest.mark.heavy
def test_user_env_module_reaches_the_actors_and_env_faults_are_one_line(tmp_path: Path) -> None:
    """One real local Ray (in a subprocess: its own job runtime env and working directory)."""
    (tmp_path / "user_envs.py").write_text(USER_ENVS)
    (tmp_path / "late_envs.py").write_text(USER_ENVS.replace("Mine", "Late"))
    res = subprocess.run(
        [sys.executable, "-c", ACTOR_SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith(("OK", "ERROR", "NO ERROR"))]
    assert res.returncode == 0 and len(lines) == 4, res.stdout + res.stderr
    assert lines[0] == "OK user/Mine-v0"
    assert lines[1].startswith("ERROR envs.val.late: unknown env id 'user/Late-v0' in a Ray worker")
    assert "--import MOD" in lines[1]
    assert lines[2].startswith("ERROR envs.train.sokoban: agentrl/SimpleSokoban-v0(bogus=1) failed: TypeError")
    assert "'bogus'" in lines[2]
    assert lines[3].startswith("ERROR envs.train.sokoban.agent: cannot import agent 'no_such_pkg:agent'"), lines[3]


class FlakySokoban(SokobanEnv):
    """step() raises on odd task seeds (demo episode i plays seed 2_000_000 + i), or always with fail="all"."""

    def __init__(self, fail: str = "odd", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail = fail

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.broken = self.fail == "all" or bool((seed or 0) % 2)
        return super().reset(seed=seed, options=options)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.broken:
            raise RuntimeError("env bug")
        return super().step(action)


register_env("tests/FlakySokoban-v0", FlakySokoban)


@pytest.mark.heavy
def test_an_engine_that_cannot_load_ends_the_warm_start_beside_it_in_one_line(tmp_path: Path) -> None:
    """Engines load while the warm start runs: a failure ends the run at once (2,000 SFT steps take minutes)."""
    run = tmp_path / "run"
    res = agentrl(
        "train", str(ROOT / "tests" / "configs" / "tiny_pipeline.yaml"), "rollout.engine_kwargs={no_such_arg: 1}",
        "trainer.sft.steps=2000", f"logging.run_dir={run}",
    )  # fmt: skip
    assert_one_line_error(res, "rollout engine 0 could not load", "no_such_arg")
    assert not [r for r in read_jsonl(run / "metrics.jsonl") if "sft/seconds" in r], "the warm start was cut short"


def test_warm_start_skips_and_counts_failing_demo_episodes(tiny_model_path: str, caplog) -> None:
    from transformers import AutoTokenizer

    from agentrl.run.warm_start import expert_samples

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = Config.model_validate({"envs": {"train": {"s": {"env_id": "tests/FlakySokoban-v0"}}}})
    with caplog.at_level(logging.WARNING):
        demos = expert_samples(cfg, tokenizer, 6)
    assert demos.failed_episodes == 3
    assert {s.episode_id for s in demos} == {"demo/s/0", "demo/s/2", "demo/s/4"}  # failed episodes leave nothing
    warnings = [r.getMessage() for r in caplog.records if "env bug" in r.getMessage()]
    assert len(warnings) == 1  # the first failure of the kind, not one per episode
    flaky = {"env_id": "tests/FlakySokoban-v0", "kwargs": {"fail": "all"}}
    every = Config.model_validate({"envs": {"train": {"s": flaky}}})
    with pytest.raises(ConfigError, match=r"all 4 expert demo episodes failed.*RuntimeError: env bug"):
        expert_samples(every, tokenizer, 4)


def test_env_manager_logs_the_first_failure_of_each_kind(caplog) -> None:
    from agentrl.envmanager.manager import FirstOfKind

    log = FirstOfKind("env manager 0")
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            log(f"episode {i}", "RuntimeError: env bug at step 3")
        log("episode 9", "TimeoutError: env call timed out")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "episode 0" in messages[0] and "TimeoutError" in messages[1]


def test_a_failing_user_module_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken on import')\n")
    res = agentrl("config", "show", str(EXAMPLE), "--import", "broken", cwd=tmp_path)
    assert_one_line_error(res, "--import broken", "broken on import")
