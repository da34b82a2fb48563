"""Escapes from the built-in `python` tool's sandbox (issue 22 §4), each attempted for real and expected to fail.

Real bubblewrap (scripts/setup_venv.sh installs it; without it these tests fail with the tool's refusal), real
subprocesses, and one real `agentrl serve-tools` process whose environment holds its bearer token. Processes
started inside the sandbox rename themselves (prctl PR_SET_NAME, seen as /proc/PID/comm) to a unique marker so the
host can check that none outlives the call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from agentrl.tools import pyexec
from agentrl.tools.pyexec import make_python_tool
from tests.servers import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parents[1]
sandbox = make_python_tool(timeout_s=60, memory_mb=256, max_output_bytes=20_000)
# for the tests of the wall-time limit only: a jailed interpreter has taken over 1.5 s to start on a loaded CI box
clocked = make_python_tool(timeout_s=5, memory_mb=256, max_output_bytes=20_000)

# reads every environment it can (its own, its parent's, every process's under /proc); prints entries naming {var}
READ_ENVIRONS = """\
import os
seen = [f"{{k}}={{v}}" for k, v in os.environ.items()]
for pid in [str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]:
    try:
        seen += open(f'/proc/{{pid}}/environ', 'rb').read().decode(errors='replace').split('\\0')
    except OSError:
        pass
seen = [entry for entry in seen if {var!r} in entry]
print(len(seen), 'found', seen)
"""


def _marker() -> str:
    return "arl" + uuid.uuid4().hex[:10]  # /proc/PID/comm keeps 15 characters


def _live_pids_named(comm: str) -> list[int]:
    """Host pids whose /proc/PID/comm is `comm` (zombies excluded: they are dead and hold nothing)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if name == comm and state != "Z":
            found.append(int(pid))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


async def test_normal_path_still_works():
    r = await sandbox({"code": "print(1 + 1)"})
    assert r.ok and r.content == "2"
    start = time.perf_counter()
    r = await clocked({"code": "while True:\n    pass"})
    assert "wall-time limit of 5s" in r.content and time.perf_counter() - start < 20
    r = await sandbox({"code": "x = bytearray(1 << 30)"})
    assert "MemoryError" in r.content and "memory limit of 256 MiB" in r.content
    big = "x = 1\n" * 40_000 + "print(x + 1)"  # larger than a pipe buffer and than one argv string
    assert (await sandbox({"code": big})).content == "2"


async def test_no_process_environment_leaks_a_secret(spawn):
    secret = "s3cret-" + uuid.uuid4().hex
    spawn(["sleep", "30"], env={"PATH": os.environ["PATH"], "AGENTRL_SECRET": secret})
    r = await sandbox({"code": READ_ENVIRONS.format(var="AGENTRL_SECRET")})
    assert "found" in r.content  # the snippet really ran
    assert secret not in r.content and "AGENTRL_SECRET" not in r.content


async def test_cannot_read_host_passwd_or_shadow():
    code = (
        "for path in ('/etc/shadow', '/etc/passwd'):\n"
        "    try:\n"
        "        print(path, open(path).read())\n"
        "    except OSError as err:\n"
        "        print(path, type(err).__name__)\n"
    )
    r = await sandbox({"code": code})
    assert "/etc/shadow" in r.content and "/etc/passwd" in r.content
    assert "root:" not in r.content


async def test_cannot_write_outside_its_directory(tmp_path):
    name = f"agentrl-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, ROOT / name, Path.home() / name, tmp_path / name, Path("/") / name]
    code = (
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('escaped')\n"
        "        print(path, 'written')\n"
        "    except OSError as err:\n"
        "        print(path, type(err).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    try:
        r = await sandbox({"code": code})
        assert r.content.endswith("fine")  # its own directory is writable
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


async def test_private_tmp_is_capped():
    code = (
        "import os\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(10):\n"
        "        with open(f'/tmp/f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (15 << 20))\n"
        "        written += 15\n"
        "except OSError as err:\n"
        "    print(type(err).__name__, written)\n"
    )
    r = await sandbox({"code": code})  # 150 MiB asked for, in files under the 16 MiB file-size limit
    assert r.content.startswith("OSError") and int(r.content.split()[1]) <= 64


async def test_no_network_even_to_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
            "    print('connected')\n"
            "except OSError as err:\n"
            "    print('failed', type(err).__name__)\n"
        )
        r = await sandbox({"code": code})
        assert r.content.startswith("failed")
        with pytest.raises(TimeoutError):
            listener.accept()[0].close()


async def test_cannot_see_other_processes():
    r = await sandbox({"code": "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"})
    pids = json.loads(r.content)
    assert len(pids) <= 3 and max(pids) < 10  # bubblewrap's init and the interpreter, in their own namespace


async def test_fork_bomb_is_bounded_and_cleaned_up():
    mark = _marker()
    code = (
        "import ctypes, os, time\n"
        "started = failed = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        failed += 1\n"
        "        continue\n"
        "    if pid == 0:\n"
        f"        ctypes.CDLL(None).prctl(15, {mark.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    started += 1\n"
        "print(started, failed)\n"
    )
    try:
        r = await sandbox({"code": code})
        started, failed = map(int, r.content.split()[:2])
        assert started + failed == 200 and failed >= 150
        assert _live_pids_named(mark) == []
    finally:
        _kill_all(_live_pids_named(mark))


@pytest.mark.parametrize("ending", ["exit", "timeout"])
async def test_detached_child_dies_with_the_call(ending):
    mark = _marker()
    code = (
        "import ctypes, os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        devnull = os.open(os.devnull, os.O_RDWR)\n"
        "        for fd in (0, 1, 2):\n"
        "            os.dup2(devnull, fd)\n"
        f"        ctypes.CDLL(None).prctl(15, {mark.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
        "        os.write(w, b'x')\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.read(r, 1)\n"
        "print('ready', flush=True)\n"
    )
    if ending == "timeout":
        code += "time.sleep(60)\n"
    try:
        r = await (clocked if ending == "timeout" else sandbox)({"code": code})
        assert r.content.startswith("ready")  # the grandchild was alive and renamed when the snippet returned
        assert ("wall-time limit" in r.content) == (ending == "timeout")
        assert _live_pids_named(mark) == []
    finally:
        _kill_all(_live_pids_named(mark))


async def test_refuses_without_isolation_unless_unsafe(monkeypatch):
    monkeypatch.setattr(pyexec, "BWRAP", "/nonexistent/bwrap")
    r = await sandbox({"code": "print(1 + 1)"})
    assert not r.ok and "bubblewrap" in r.content and "python_unsafe" in r.content
    assert len(r.content.splitlines()) == 1
    unsafe = make_python_tool(timeout_s=60, unsafe=True)
    assert (await unsafe({"code": "print(1 + 1)"})).content == "2"
    assert (await pyexec.python_unsafe({"code": "print(2 + 2)"})).content == "4"


def test_a_server_that_could_only_refuse_python_calls_does_not_start(tmp_path, monkeypatch):
    from agentrl.tools.serve import ServeError, load_tools_file

    tools_file = tmp_path / "tools.yaml"
    tools_file.write_text("sets:\n  m:\n    python: {python: agentrl.tools.pyexec:python}\n")
    assert [t.name for t in load_tools_file(tools_file)] == ["python"]  # bwrap works here
    monkeypatch.setattr(pyexec, "BWRAP", "/nonexistent/bwrap")
    with pytest.raises(ServeError, match=r"tools.sets.m.python: python sandbox unavailable .*install bubblewrap"):
        load_tools_file(tools_file)
    tools_file.write_text("sets:\n  m:\n    python: {python: agentrl.tools.pyexec:python_unsafe}\n")
    assert [t.name for t in load_tools_file(tools_file)] == ["python"]  # said unsafe: serves without a jail


def test_server_token_stays_out_of_the_sandbox(tmp_path, spawn):
    token = "tok-" + uuid.uuid4().hex
    tools_file = tmp_path / "tools.yaml"
    tools_file.write_text("sets:\n  m:\n    python: {python: agentrl.tools.pyexec:python}\n")
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "agentrl", "serve-tools", str(tools_file), "--port", str(port), "--token-env", "TT_TOK"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TT_TOK": token},
        cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, base)
    steal = READ_ENVIRONS.format(var="TT_TOK") + (  # and, should a token turn up, try it on the server
        "import re, urllib.request\n"
        "for found in set(re.findall(r'tok-[0-9a-f]{32}', str(seen))):\n"
        f"    req = urllib.request.Request('{base}/tools', headers={{'Authorization': 'Bearer ' + found}})\n"
        "    print('status', urllib.request.urlopen(req, timeout=2).status)\n"
    )
    r = httpx.post(
        f"{base}/tools/python/call",
        json={"arguments": {"code": steal}},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    assert r.status_code == 200
    content = r.json()["content"]
    assert "found" in content  # the snippet ran
    assert token not in content and "TT_TOK" not in content and "status 200" not in content


def test_serve_tools_takes_no_abbreviated_token_option():
    r = subprocess.run(
        [sys.executable, "-m", "agentrl", "serve-tools", "examples/tools.yaml", "--token", "TT_TOK", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "unrecognized arguments: --token" in r.stderr
