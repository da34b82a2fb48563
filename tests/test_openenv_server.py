"""`serve-envs` security and failure handling: auth, size limits, bad input (4xx, never 5xx), session caps,
idle expiry, a server that dies mid-episode, and worker recycling (one real `agentrl serve-envs` subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from agentrl.cli import main
from agentrl.envs import make_env, register_env
from agentrl.envs.remote_openenv import RemoteEnvError, close_idle_sessions
from agentrl.envs.sokoban.env import SokobanEnv
from agentrl.envserve.server import EnvServerLimits, create_app
from agentrl.tools.serve import ServerThread
from tests.servers import free_port, wait_until_healthy

SOKOBAN = "agentrl/SimpleSokoban-v0"
TOKEN = "envserve-test-token-123"
LIMITS = EnvServerLimits(max_sessions=3, max_body_bytes=4096, idle_timeout_s=1.0)


@pytest.fixture(scope="module")
def url():
    with ServerThread(create_app([SOKOBAN], token=TOKEN, limits=LIMITS)) as base:
        yield base


def _until_no_sessions(url: str, timeout_s: float = 10.0) -> None:
    """Wait until the server has seen every session close (it counts them in /health), not for a fixed time."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=5).json()["sessions"]:
        assert time.monotonic() < deadline, "the server still counts open sessions"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _no_pooled_sessions(url):
    """Pooled sessions of earlier tests count against the server's session cap: start each test without."""
    close_idle_sessions()
    _until_no_sessions(url)
    yield
    close_idle_sessions()


def ws(url: str, token: str | None = TOKEN, query: str = ""):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return connect(url.replace("http", "ws") + "/ws" + query, additional_headers=headers, open_timeout=5).__enter__()


def ask(sock, kind: str, data: dict | None = None) -> dict:
    sock.send(json.dumps({"type": kind, "data": data or {}}))
    return json.loads(sock.recv(timeout=5))


def test_token_required_everywhere_but_health(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/reset", json={"seed": 1}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/reset", json={"seed": 1}, headers=auth).json()["observation"]["text"]
    for token in (None, "wrong"):
        with pytest.raises(InvalidStatus) as err:
            ws(url, token)
        assert err.value.response.status_code == 401
    os.environ["ENVSERVE_TEST_TOKEN"] = TOKEN
    env = make_env("agentrl/OpenEnv-v0", url=url, token_env="ENVSERVE_TEST_TOKEN")
    assert env.reset(seed=0)[0] == make_env(SOKOBAN).reset(seed=0)[0]
    env.close()


def test_non_loopback_bind_needs_a_token(capsys):
    assert main(["serve-envs", SOKOBAN, "--host", "0.0.0.0"]) == 2
    assert "without auth" in capsys.readouterr().err


def test_bad_http_input_is_4xx(url):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    big = {"seed": 1, "episode_id": "x" * 5000}
    assert httpx.post(f"{url}/reset", json=big, headers=auth).status_code == 413
    assert httpx.post(f"{url}/reset", content=b"{not json", headers=auth).status_code == 422
    assert httpx.post(f"{url}/reset", json={"seed": -1}, headers=auth).status_code == 422
    assert httpx.post(f"{url}/reset", json={"env_id": "nope"}, headers=auth).status_code == 404
    assert httpx.post(f"{url}/step", json={"action": {"text": "x"}}, headers=auth).status_code == 422
    junk = [[], "x", None, 1.5, {"seed": 2**70}, {"seed": True}, {"action": []}, {"action": {"message": 3}}]
    for body in junk:
        for path in ("/reset", "/step"):
            status = httpx.post(f"{url}{path}", json=body, headers=auth).status_code
            assert 400 <= status < 500, (path, body, status)
    ok = httpx.post(f"{url}/step", json={"action": {"message": "<answer>Up</answer>"}, "seed": 0}, headers=auth)
    assert ok.status_code == 200 and ok.json()["reward"] is not None


def test_bad_session_input_is_an_error_frame_and_the_session_goes_on(url):
    with pytest.raises(InvalidStatus) as err:
        ws(url, query="?env_id=agentrl/Nope-v0")
    assert err.value.response.status_code == 404
    sock = ws(url)
    sock.send("{not json")
    assert json.loads(sock.recv(timeout=5))["data"]["code"] == "INVALID_JSON"
    assert ask(sock, "dance")["data"]["code"] == "UNKNOWN_TYPE"
    assert ask(sock, "reset", {"seed": "x"})["data"]["code"] == "VALIDATION_ERROR"
    assert ask(sock, "step", {"text": "x"})["data"]["code"] == "VALIDATION_ERROR"
    assert ask(sock, "reset", {"seed": 2})["type"] == "observation"
    sock.send(json.dumps({"type": "step", "data": {"message": "x" * 5000}}))
    reply = json.loads(sock.recv(timeout=5))
    assert reply["data"]["code"] == "MESSAGE_TOO_LARGE" and reply["data"]["status"] == 413
    sock.close()


def test_session_cap_is_503_not_500(url):
    socks = [ws(url) for _ in range(LIMITS.max_sessions)]
    try:
        with pytest.raises(InvalidStatus) as err:
            ws(url)
        assert err.value.response.status_code == 503
        assert "too many open sessions" in err.value.response.body.decode()
    finally:
        for s in socks:
            s.close()
    _until_no_sessions(url)
    ws(url).close()  # slots come back


def test_idle_sessions_expire_and_the_pool_reopens(url):
    sock = ws(url)
    ask(sock, "reset", {"seed": 0})
    reply = json.loads(sock.recv(timeout=5))  # nothing sent: the server expires it after idle_timeout_s
    assert reply["data"]["code"] == "SESSION_EXPIRED"
    os.environ["ENVSERVE_TEST_TOKEN"] = TOKEN
    env = make_env("agentrl/OpenEnv-v0", url=url, token_env="ENVSERVE_TEST_TOKEN", max_sessions=1)
    env.reset(seed=0)
    env.close()  # pooled, then expired on the server while idle
    time.sleep(LIMITS.idle_timeout_s + 0.5)
    env = make_env("agentrl/OpenEnv-v0", url=url, token_env="ENVSERVE_TEST_TOKEN", max_sessions=1)
    assert env.reset(seed=1)[0] == make_env(SOKOBAN).reset(seed=1)[0]  # a fresh session, transparently
    env.close()


class SlowSokoban(SokobanEnv):
    """Every step takes 3 s: a stuck env behind the server."""

    def step(self, action):
        time.sleep(3.0)
        return super().step(action)


register_env("tests/SlowSokoban-v0", f"{__name__}:SlowSokoban", dim_room=(6, 6), num_boxes=1, max_steps=15)


def test_slow_server_is_a_clear_env_error():
    with ServerThread(create_app(["tests/SlowSokoban-v0"])) as base:
        env = make_env("agentrl/OpenEnv-v0", url=base, timeout_s=1.0)
        env.reset(seed=0)
        with pytest.raises(RemoteEnvError, match=r"step: no reply within 1s \(session dropped\)"):
            env.step("<answer>Up</answer>")
        assert env.session is None  # the desynced socket is never reused


@pytest.fixture(scope="module")
def served():
    """One real `agentrl serve-envs` (2 workers) for the tests that kill or recycle it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve-envs", SOKOBAN, "--port", str(port), "--workers", "2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        yield proc, base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_workers_share_the_port_and_a_dead_server_fails_the_episode(served):
    proc, base = served
    # new connections spread over both workers (SO_REUSEPORT); the second may still be starting under load
    pids: set[int] = set()
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        pids |= {httpx.get(f"{base}/health").json()["pid"] for _ in range(20)}
    assert len(pids) == 2, pids
    env = make_env("agentrl/OpenEnv-v0", url=base)
    local = make_env(SOKOBAN)
    assert env.reset(seed=4) == local.reset(seed=4)
    assert env.step("<answer>Up</answer>") == local.step("<answer>Up</answer>")
    proc.terminate()
    proc.wait(timeout=20)
    with pytest.raises(RemoteEnvError, match=r"session failed|server error"):
        for _ in range(3):
            env.step("<answer>Up</answer>")
    with pytest.raises(RemoteEnvError, match="cannot open a session"):
        make_env("agentrl/OpenEnv-v0", url=base).reset(seed=0)


def test_a_worker_past_its_memory_limit_is_replaced_and_its_sessions_end_clearly():
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl", "serve-envs", SOKOBAN, "--port", str(port), "--max-worker-rss-mb", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        sock = ws(base, token=None)
        assert ask(sock, "reset", {"seed": 0})["type"] == "observation"
        reply = json.loads(sock.recv(timeout=60))  # every worker is over 1 MiB: this one is retired
        assert reply["data"]["code"] == "WORKER_RETIRED" and "RSS over 1 MiB" in reply["data"]["message"]
        env = make_env("agentrl/OpenEnv-v0", url=base)  # the replacement serves the next session
        assert env.reset(seed=0) == make_env(SOKOBAN).reset(seed=0)
        env.close()
        close_idle_sessions()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert '"event": "worker_recycled"' in err


def test_env_kwargs_flag_is_checked_before_serving(capsys):
    cases = {
        "agentrl/SimpleSokoban-v0": "expected ENV_ID=JSON",
        "agentrl/FrozenLake-v0={}": "is not served here",
        f"{SOKOBAN}={{not json": "not JSON",
        f"{SOKOBAN}=[1]": "expected a JSON object",
        f'{SOKOBAN}={{"no_such_kwarg": 1}}': "no_such_kwarg",
    }
    for flag, message in cases.items():
        assert main(["serve-envs", SOKOBAN, "--env-kwargs", flag]) == 2
        assert message in capsys.readouterr().err, flag


def test_served_env_gets_its_env_kwargs():
    """A real `serve-envs` with --env-kwargs plays the same episode as the env made in process with those kwargs."""
    port = free_port()
    kwargs = {"mark_revisits": True}
    cmd = [sys.executable, "-m", "agentrl", "serve-envs", SOKOBAN, "--port", str(port),
           "--env-kwargs", f"{SOKOBAN}={json.dumps(kwargs)}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        remote, local = make_env("agentrl/OpenEnv-v0", url=base), make_env(SOKOBAN, **kwargs)
        assert remote.reset(seed=3)[0] == local.reset(seed=3)[0]
        moves = ["<answer>Up</answer>", "<answer>Down</answer>"] * 2  # back and forth: positions shown again
        observations = [remote.step(m)[0] for m in moves]
        assert observations == [local.step(m)[0] for m in moves]
        assert any("(visit 2)" in obs for obs in observations)
        remote.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
