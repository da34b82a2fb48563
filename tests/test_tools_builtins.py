"""Built-in tools called in-process: calculator safety, python sandbox limits, BM25 search, Sokoban hint."""

from __future__ import annotations

import os
import time

import pytest

from agentrl.tools.calculator import calculator, evaluate
from agentrl.tools.pyexec import make_python_tool
from agentrl.tools.search import make_search_tool, search
from agentrl.tools.sokoban_hint import sokoban_hint

# Only the tests of the wall-time limit use the short clock: on a loaded 2-core CI box a jailed interpreter has taken
# over 1.5 s just to start, so every other test runs with a clock it cannot reach and checks what it is about.
clocked = make_python_tool(timeout_s=4, memory_mb=256, max_output_bytes=2000)
sandbox = make_python_tool(timeout_s=60, memory_mb=256, max_output_bytes=2000)


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(3 + 4) * 12 / 5", 16.8),
        ("2 ** 10", 1024),
        ("7 // 2 + 7 % 2", 4),
        ("-(-3)", 3),
        ("sqrt(16) + abs(-2)", 6),
        ("max(1, 5, 3) - min(4, 2)", 3),
        ("round(pi, 2)", 3.14),
        ("2 ** -1", 0.5),
        ("10 ** 100", 10**100),
        ("+".join(["1"] * 150), 150),
    ],
)
def test_calculator_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("9**9**9", "too large"),
        ("(10**1000)**5", "too large"),
        ("(10**1000)*(10**1000)*(10**1000)*(10**1000)*(10**1000)", "too large"),
        ("__import__('os').system('true')", "unsupported"),
        ("().__class__", "unsupported"),
        ("open('/etc/passwd')", "unsupported"),
        ("x + 1", "unsupported"),
        ("'a' * 3", "unsupported"),
        ("lambda: 1", "unsupported"),
        ("1 / 0", "ZeroDivisionError"),
        ("(-8) ** 0.5", "complex"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 400 + "1" + ")" * 400, "longer than"),
        ("-" * 300 + "1", "nested too deeply"),
    ],
)
async def test_calculator_refuses_and_stays_fast(expr, message):
    start = time.perf_counter()
    r = await calculator({"expression": expr})
    assert time.perf_counter() - start < 5.0  # instant when idle; a bound only an evaluated bomb would break
    assert not r.ok and message in r.error


async def test_sandbox_runs_code_in_fresh_dir_without_secrets(monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "hunter2")
    code = (
        "import os, sys\n"
        "print('secret' if 'AGENTRL_TEST_SECRET' in os.environ else 'clean')\n"
        "print(sorted(os.listdir('.')))\n"
        "open('left_behind.txt', 'w').write('x')\n"
        "print(sys.flags.isolated, 6 * 7)\n"
    )
    first = await sandbox({"code": code})
    assert first.ok
    lines = first.content.splitlines()
    assert lines[0] == "clean"
    assert lines[1] == "['snippet.py']"
    assert lines[2] == "1 42"
    second = await sandbox({"code": code})
    assert second.content.splitlines()[1] == "['snippet.py']"  # nothing survives between calls


async def test_sandbox_reports_errors_and_exit_codes():
    r = await sandbox({"code": "raise ValueError('nope')"})
    assert "ValueError: nope" in r.content and "[exit code 1]" in r.content
    r = await sandbox({"code": "x = 1"})
    assert "no output" in r.content


async def test_sandbox_stops_infinite_loop_at_wall_limit():
    start = time.perf_counter()
    r = await clocked({"code": "print('start', flush=True)\nwhile True:\n    pass\n"})
    elapsed = time.perf_counter() - start
    assert "start" in r.content and "wall-time limit of 4s" in r.content
    assert 3.9 < elapsed < 20.0  # stopped at the 4 s wall limit (upper bound loose for loaded machines)


async def test_sandbox_kills_forked_children_too():
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)\n"
    start = time.perf_counter()
    r = await clocked({"code": code})
    assert "wall-time limit" in r.content and time.perf_counter() - start < 20.0


async def test_sandbox_stops_memory_bomb():
    r = await sandbox({"code": "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n"})
    assert "MemoryError" in r.content and "memory limit of 256 MiB" in r.content
    r = await sandbox({"code": "x = bytearray(8 << 30)"})
    assert "MemoryError" in r.content


async def test_sandbox_truncates_huge_output():
    start = time.perf_counter()
    r = await sandbox({"code": "while True:\n    print('y' * 1000)\n"})
    assert "output truncated at 2000 bytes" in r.content and "wall-time" not in r.content  # stopped on overflow
    assert len(r.content) < 2200 and time.perf_counter() - start < 20.0  # stopped long before its 60 s clock


async def test_search_finds_relevant_passages():
    r = await search({"query": "What is the capital of Japan?", "k": 2})
    assert r.ok and r.content.startswith("[1] Japan:") and "Tokyo" in r.content
    assert r.content.count("\n\n") <= 1
    r = await search({"query": "GRPO group advantage"})
    assert "[1] GRPO:" in r.content
    assert (await search({"query": "zzzqqqxx"})).content == "No results."
    bad = await search({"query": "x", "k": 99})
    assert not bad.ok and "k:" in bad.error


async def test_search_custom_corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"title": "Alpha", "text": "walrus tusks"}\n{"title": "Beta", "text": "penguin wings"}\n')
    t = make_search_tool(path)
    assert (await t({"query": "penguin"})).content == "[1] Beta: penguin wings"


async def test_sokoban_hint_gives_solver_move():
    pytest.importorskip("agentrl.envs.sokoban")
    from agentrl.envs.sokoban import parse_grid, solve

    grid = "#######\n#P_X_O#\n#######"
    r = await sokoban_hint({"grid": grid})
    assert r.ok and r.content.startswith("Right")
    assert r.content.split()[0] == solve(parse_grid(grid))[0]
    r = await sokoban_hint({"grid": "#######\n#O_X_P#\n#######"})
    assert r.content.startswith("Left")
    stuck = await sokoban_hint({"grid": "######\n#PX__#\n#___O#\n######"})  # box pushed against the top wall
    assert stuck.ok and stuck.content.startswith("No hint")
    bad = await sokoban_hint({"grid": "hello"})
    assert not bad.ok and "player" in bad.error


def test_builtin_modules_never_call_eval():
    import agentrl.tools.calculator as calc

    with open(calc.__file__) as f:
        src = f.read()
    assert "eval(" not in src.replace("_eval(", "") and "exec(" not in src
    assert os.path.exists(os.path.join(os.path.dirname(calc.__file__), "search_corpus.json"))
