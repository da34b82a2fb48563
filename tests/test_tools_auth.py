"""Bearer-token auth on the tool server, and `agentrl serve-tools` started as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agentrl.addresses import is_loopback
from agentrl.tools import ToolClient
from agentrl.tools.calculator import calculator
from agentrl.tools.serve import ServeError, ServerThread, check_bind, load_tools_file
from agentrl.tools.server import create_app
from tests.servers import free_port, wait_until_healthy

TOKEN = "auth-test-token-abcdef"
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tools.yaml"


@pytest.fixture(scope="module")
def url():
    with ServerThread(create_app([calculator], token=TOKEN)) as base:
        yield base


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/tools"), ("POST", "/tools/calculator/call"), ("POST", "/sessions/open"), ("GET", "/openapi.json")],
)
async def test_missing_or_wrong_token_is_401(url, headers, method, path):
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.request(
            method, path, headers=headers, json={"arguments": {"expression": "1"}, "session_id": "x"}
        )
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"detail": "missing or wrong bearer token"}


async def test_right_token_works_and_health_is_open(url):
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.post(
            "/tools/calculator/call",
            json={"arguments": {"expression": "2+2"}},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200 and r.json()["content"] == "4"
        schema = (await http.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


async def test_client_with_wrong_token_tells_the_model(url):
    async with ToolClient(url, token="nope") as c:
        r = await c.call("calculator", {"expression": "1"})
    assert not r.ok and "401" in r.error


def test_bind_rules():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host)
        check_bind(host, None)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ServeError, match="without auth"):
            check_bind(host, None)
        check_bind(host, "a-token")


def test_load_tools_file(tmp_path):
    names = [t.name for t in load_tools_file(EXAMPLE)]
    assert names == ["calculator", "python", "search", "sokoban_hint"]
    run_cfg = tmp_path / "run.yaml"
    run_cfg.write_text("tools:\n  sets:\n    m:\n      calc: {python: agentrl.tools.calculator:calculator}\n")
    assert [t.name for t in load_tools_file(run_cfg)] == ["calc"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("sets:\n  m:\n    calc: {python: agentrl.tools.calculator:calculator, colour: red}\n")
    with pytest.raises(ServeError, match="colour"):
        load_tools_file(bad)
    remote = tmp_path / "remote.yaml"
    remote.write_text("sets:\n  m:\n    calc: {url: 'http://127.0.0.1:1'}\n")
    with pytest.raises(ServeError, match="python: tools only"):
        load_tools_file(remote)


def _cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl", "serve-tools", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def test_cli_refuses_public_bind_without_token():
    r = _cli(str(EXAMPLE), "--host", "0.0.0.0", "--port", "1")
    assert r.returncode == 2
    assert "refusing to serve tools on 0.0.0.0 without auth" in r.stderr and "--token-env" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_usage_errors_are_one_line():
    r = _cli(str(EXAMPLE), "--token-env", "AGENTRL_SURELY_UNSET_VAR", "--port", "1")
    assert r.returncode == 2 and "AGENTRL_SURELY_UNSET_VAR" in r.stderr and "Traceback" not in r.stderr
    r = _cli("/no/such/tools.yaml", "--port", "1")
    assert r.returncode == 2 and "/no/such/tools.yaml" in r.stderr and "Traceback" not in r.stderr


def test_cli_serves_with_token_and_logs_json(spawn):
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "agentrl", "serve-tools", str(EXAMPLE), "--port", str(port), "--token-env", "TT_TOKEN"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TT_TOKEN": TOKEN},
        cwd=ROOT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, base)
        assert httpx.get(f"{base}/tools").status_code == 401
        r = httpx.post(
            f"{base}/tools/calculator/call",
            json={"arguments": {"expression": "6*7"}},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200 and r.json()["content"] == "42"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert '"event": "serving"' in err
    assert '"path": "/tools/calculator/call", "status": 200' in err
    assert TOKEN not in err
