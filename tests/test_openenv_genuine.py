"""agentrl against genuine OpenEnv code (openenv 0.10.0, in its own virtualenv `.venv-openenv`): a server built with
openenv's own `create_fastapi_app` played through `agentrl/OpenEnv-v0` with its fields read from `/schema` and
passing `check-env` with only its URL; and openenv's own `GenericEnvClient` playing `agentrl serve-envs`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.envs import make_env
from agentrl.envs.remote_openenv import RemoteEnvSettings, _text_field, schema_fields
from agentrl.envserve.server import create_app
from agentrl.tools.serve import ServerThread
from tests.servers import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parents[1]
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"


def _openenv_python() -> str:
    if not OPENENV_PYTHON.exists():
        pytest.fail(f"{OPENENV_PYTHON} is missing: `bash scripts/setup_venv.sh` makes it (openenv's own virtualenv)")
    return str(OPENENV_PYTHON)


@pytest.fixture(scope="module")
def genuine_server():
    """The reverse-the-word env on openenv's own server, in its own process."""
    port = free_port()
    script = ROOT / "tests" / "openenv_genuine" / "reverse_server.py"
    proc = subprocess.Popen([_openenv_python(), str(script), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, timeout_s=120)  # openenv imports ~100 packages: ~10 s here, more under load
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_genuine_openenv_server_plays_with_its_fields_read_from_its_schema(genuine_server):
    env = make_env("agentrl/OpenEnv-v0", url=genuine_server)
    assert env.fields == ("prompt", "message")  # from the Action and Observation models openenv publishes
    obs, _ = env.reset(seed=3)
    assert obs.startswith("Reverse the word: ")
    word = obs.rsplit(" ", 1)[1]
    obs, reward, terminated, truncated, info = env.step(word[::-1])
    assert (obs, reward, terminated, truncated) == ("correct", 1.0, True, False) and info["metrics"]["success"] == 1.0
    env.reset(seed=3)
    obs, reward, terminated, _, info = env.step(word)
    assert (obs, reward, terminated, info["metrics"]["success"]) == ("wrong", 0.0, True, 0.0)
    assert env.contract == frozenset()  # it promises none of agentrl's own rules
    assert env.system_prompt() == "" and len(env.random_action(__import__("random").Random(0))) >= 1
    named = make_env("agentrl/OpenEnv-v0", url=genuine_server, observation_field="prompt", action_field="message")
    assert named.fields == ("prompt", "message") and named.reset(seed=3)[0].startswith("Reverse the word: ")
    env.close(), named.close()


def test_check_env_passes_a_genuine_openenv_server_given_only_its_url(genuine_server):
    out = subprocess.run([sys.executable, "-m", "agentrl", "check-env", genuine_server], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agentrl/OpenEnv-v0: OK" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if "warning" in line]
    assert any("unparsable_is_noop" in w for w in warnings) and any("system_prompt" in w for w in warnings)
    assert "FAIL" not in out.stderr


def test_schema_fields_pick_the_text_field_or_say_which_to_name():
    obs = {"title": "Obs", "properties": {"done": {"type": "boolean"}, "prompt": {"type": "string"},
                                          "metadata": {"type": "object"}}}  # fmt: skip
    assert _text_field(obs, "text") == "prompt"
    assert _text_field({"properties": {"text": {"type": "string"}, "note": {"type": "string"}}}, "text") == "text"
    two = {"title": "Act", "properties": {"a": {"type": "string"}, "b": {"anyOf": [{"type": "string"}]}},
           "required": ["b"]}  # fmt: skip
    assert _text_field(two, "message") == "b"  # the required one
    with pytest.raises(ValueError, match=r"several text fields fit in Act: \['a', 'b'\]"):
        _text_field({**two, "required": []}, "message")
    assert _text_field({}, "message") == "message"  # no schema: OpenEnv's usual name
    with ServerThread(create_app(["agentrl/SimpleSokoban-v0"])) as base:  # agentrl's own server publishes text
        assert schema_fields(RemoteEnvSettings(url=base), None) == ("text", "message")
    nowhere = RemoteEnvSettings(url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=2)
    assert schema_fields(nowhere, None) == ("text", "message")  # unreachable now: the episode's session says so


CLIENT = """
import json, sys
from openenv.core.generic_client import GenericEnvClient
with GenericEnvClient(base_url=sys.argv[1]).sync() as client:
    first = client.reset(seed=5)
    moved = client.step({"message": "<answer>Up</answer>"})
    bad = client.step({"message": "no idea"})
print(json.dumps({"first": first.observation, "moved": [moved.observation, moved.reward, moved.done],
                  "bad": [bad.observation, bad.reward, bad.done]}))
"""


def test_openenvs_own_client_plays_agentrl_serve_envs():
    env = make_env("agentrl/SimpleSokoban-v0")
    obs, _ = env.reset(seed=5)
    moved = env.step("<answer>Up</answer>")
    bad = env.step("no idea")
    with ServerThread(create_app(["agentrl/SimpleSokoban-v0"])) as base:
        out = subprocess.run([_openenv_python(), "-c", CLIENT, base], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"]["text"] == obs
    assert got["moved"][0]["text"] == moved[0] and got["moved"][1:] == [moved[1], moved[2]]
    assert got["bad"][0]["text"] == bad[0] and got["bad"][0]["metadata"]["agentrl"]["info"]["metrics"][
        "action_is_valid"] == 0.0  # fmt: skip
