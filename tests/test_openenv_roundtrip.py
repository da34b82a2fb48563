"""agentrl/OpenEnv-v0 against `serve-envs`' app: the same episodes as in process, check-env, pooling, config.

One in-process server per module (a uvicorn thread on a free loopback port): no subprocess, no Ray, no vLLM.
"""

from __future__ import annotations

import json
import random

import pytest
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from agentrl.cli import main
from agentrl.envs import make_env
from agentrl.envs.remote_openenv import RemoteOpenEnv, session_pool
from agentrl.envserve.server import create_app
from agentrl.tools.serve import ServerThread

SOKOBAN = "agentrl/SimpleSokoban-v0"


@pytest.fixture(scope="module")
def url():
    with ServerThread(create_app([SOKOBAN, "agentrl/GuessNumber-v0"])) as base:
        yield base


def _play(env, seed: int, actions: list[str] | None = None, invalid_every: int = 3) -> tuple[list, list[str]]:
    """One episode: the transcript and the actions taken. Without `actions` the env's own expert (odd seeds)
    or random agent picks them, with an unparsable or unknown action every `invalid_every` turns."""
    out: list = [env.reset(seed=seed)]
    taken: list[str] = []
    rng = random.Random(seed)
    for turn in range(env.max_steps):
        if actions is not None:
            action = actions[turn]
        elif turn % invalid_every == invalid_every - 1:
            action = "no idea" if turn % 2 else "<answer>Sideways</answer>"
        else:
            action = (env.expert_action() if seed % 2 else None) or env.random_action(rng)
        taken.append(action)
        obs, reward, terminated, truncated, info = env.step(action)
        out.append((action, obs, reward, terminated, truncated, info["metrics"]))
        if terminated or truncated:
            break
    return out, taken


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 7])
def test_remote_episodes_equal_in_process(url, seed):
    local = make_env(SOKOBAN)
    remote = make_env("agentrl/OpenEnv-v0", url=url)
    try:
        assert remote.system_prompt() == local.system_prompt()
        want, actions = _play(local, seed)
        got, _ = _play(remote, seed, actions)
        assert got == want
        assert remote.max_steps == local.max_steps
    finally:
        remote.close()


def test_expert_and_random_actions_come_from_the_server(url):
    remote, local = make_env("agentrl/OpenEnv-v0", url=url), make_env(SOKOBAN)
    remote.reset(seed=5), local.reset(seed=5)
    assert remote.expert_action() == local.expert_action()
    assert remote.random_action(random.Random(1)) == remote.random_action(random.Random(1))
    remote.close()


def test_second_env_on_the_same_server(url):
    remote = make_env("agentrl/OpenEnv-v0", url=url, env="agentrl/GuessNumber-v0")
    local = make_env("agentrl/GuessNumber-v0")
    assert remote.reset(seed=3) == local.reset(seed=3)
    assert remote.step("<answer>50</answer>") == local.step("<answer>50</answer>")
    remote.close()


def test_sessions_are_pooled_across_episodes(url):
    pool = session_pool(RemoteOpenEnv(url=url).settings)
    pool.close_idle()
    for seed in range(5):  # an episode per env instance, as the env manager runs them
        env = make_env("agentrl/OpenEnv-v0", url=url)
        env.reset(seed=seed)
        env.step("<answer>Up</answer>")
        env.close()
    assert pool.open == 1 and len(pool.idle) == 1


def test_check_env_against_a_served_env(url, capsys):
    assert main(["check-env", url, "--episodes", "3"]) == 0
    out = capsys.readouterr().out
    assert "agentrl/OpenEnv-v0: OK" in out and "expert  success 100.0%" in out


def test_bad_kwargs_name_the_key(url):
    with pytest.raises(ValueError, match="timeout_s"):
        make_env("agentrl/OpenEnv-v0", url=url, timeout_s=-1)
    with pytest.raises(ValueError, match="url"):
        make_env("agentrl/OpenEnv-v0", url="ftp://x").reset(seed=0)
    with pytest.raises(ValueError, match="NO_SUCH_TOKEN_VAR"):
        make_env("agentrl/OpenEnv-v0", url=url, token_env="NO_SUCH_TOKEN_VAR")


def test_env_config_validates_and_builds_like_the_env_managers(url):
    from agentrl.config.schema import Config
    from agentrl.envmanager.manager import _make_each_env, check_turn_limits

    cfg = Config.model_validate(
        {"envs": {"train": {"remote": {"env_id": "agentrl/OpenEnv-v0", "kwargs": {"url": url}, "max_turns": 10}}}}
    )
    check_turn_limits(cfg)
    env = cfg.envs.train["remote"]
    assert (
        _make_each_env([("envs.train.remote", env.env_id, dict(env.kwargs), 0, None, False)], cfg.envs.call_timeout_s)
        is None
    )
    problem = _make_each_env(
        [("envs.train.remote", env.env_id, {"url": url, "bogus": 1}, 0, None, False)], cfg.envs.call_timeout_s
    )
    assert problem is not None and "bogus" in problem


async def test_env_manager_episodes_on_a_served_env_and_a_dead_server(url, tiny_model_path):
    """The env manager's episode runner (scripted engine, no model) runs remote episodes exactly like local ones;
    a server that goes away fails those episodes with a clear RemoteEnvError and the runner goes on."""
    from transformers import AutoTokenizer

    from tests.test_envmanager_scripted import ScriptedEngine, _expert_script, _runner, _spec

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    local = await _runner(tok, ScriptedEngine(tok, _expert_script())).run(_spec(11))
    runner = _runner(tok, ScriptedEngine(tok, _expert_script()))
    remote = await runner.run(_spec(11, "agentrl/OpenEnv-v0", env_kwargs={"url": url}))
    assert remote.error is None and remote.token_ids == local.token_ids and remote.env_return == local.env_return
    assert remote.metrics == local.metrics

    server = ServerThread(create_app([SOKOBAN]))
    base = server.__enter__()

    def stop_server(episode_id: str, prompt: str) -> str:  # the server goes away after the episode started
        server.__exit__(None, None, None)  # returns once uvicorn has stopped and closed the sessions
        return "<answer>Up</answer>"

    try:
        ep = await _runner(tok, ScriptedEngine(tok, stop_server)).run(
            _spec(3, "agentrl/OpenEnv-v0", env_kwargs={"url": base})
        )
    finally:
        server.__exit__(None, None, None)
    assert ep.failed and "RemoteEnvError" in ep.error, ep.error


def _foreign_openenv_app():
    """A server in openenv 0.10's wire format with no agentrl extras (what `openenv.core.env_server.create_app`
    sends for an env with `message` actions and a `text` observation): reset/step replies and an error frame."""
    app = FastAPI()

    @app.websocket("/ws")
    async def ws(sock: WebSocket) -> None:
        await sock.accept()
        turns = 0
        try:
            while True:
                msg = json.loads(await sock.receive_text())
                if msg["type"] == "reset":
                    turns, text, reward, done = 0, f"hello {msg['data'].get('seed')}", None, False
                elif msg["type"] == "step":
                    turns += 1
                    text, reward, done = msg["data"]["message"].upper(), 1.0, turns >= 3
                else:
                    err = {"message": f"Unknown message type: {msg['type']}", "code": "UNKNOWN_TYPE"}
                    await sock.send_text(json.dumps({"type": "error", "data": err}))
                    continue
                data = {"observation": {"text": text, "metadata": {}}, "reward": reward, "done": done}
                await sock.send_text(json.dumps({"type": "observation", "data": data}))
        except WebSocketDisconnect:
            pass

    return app


def test_a_foreign_openenv_server_maps_onto_the_text_env_contract():
    with ServerThread(_foreign_openenv_app()) as base:
        env = make_env("agentrl/OpenEnv-v0", url=base, system_prompt="Shout back.", max_steps=5)
        assert env.reset(seed=7)[0] == "hello 7"
        assert env.system_prompt() == "Shout back." and env.reset(seed=8)[0] == "hello 8"
        obs, reward, terminated, truncated, info = env.step("hi")
        assert (obs, reward, terminated, truncated) == ("HI", 1.0, False, False)
        assert set(info["metrics"]) >= {"success", "action_is_valid", "action_is_effective"}
        env.step("a")
        *_, terminated, truncated, info = env.step("b")
        assert terminated and not truncated and info["metrics"]["success"] == 1.0
        assert env.expert_action() is None  # UNKNOWN_TYPE: no expert, and the session stays usable
        assert env.reset(seed=1)[0] == "hello 1"
        short = make_env("agentrl/OpenEnv-v0", url=base, max_steps=2)
        short.reset(seed=0)
        assert short.step("x")[3] is False and short.step("y")[3] is True  # our turn limit truncates
        env.close(), short.close()
