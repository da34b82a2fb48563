"""Mistakes a newcomer meets first, through the real CLI: a model path that does not exist, a model without a chat
template, a chat template that cannot render tool calls, a GPU platform on a CPU machine, a port in use for
serve-tools. Each is one line naming the fix, exit code 2, no traceback (the traceback with --verbose), and all but
the port are caught before Ray starts (seconds, not the minute a run's start-up takes)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from agentrl.models.tiny import resolve_model_path
from tests.cli_run import agentrl, assert_one_line_error

# Small runs on the built-in tiny model; an error stops each before any actor starts.
SOKOBAN = """name: newcomer
envs:
  train:
    sokoban: {env_id: agentrl/SimpleSokoban-v0, max_turns: 2, group_size: 2, groups_per_batch: 1}
trainer: {total_steps: 1}
"""
MATH_TOOLS = """name: newcomer_tools
tools:
  sets:
    calc:
      calculator: {python: agentrl.tools.calculator:calculator}
envs:
  train:
    math: {env_id: agentrl/MathTool-v0, tools: [calc], max_turns: 2, group_size: 2, groups_per_batch: 1}
trainer: {total_steps: 1}
"""
# A ChatML template that knows nothing of tools: it drops the tools list and refuses tool messages.
NO_TOOLS_TEMPLATE = """{%- for m in messages %}
{%- if m.role == 'tool' %}{{ raise_exception('tool messages are not supported') }}{%- endif %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Configs and two copies of the tiny model's config and tokenizer (no weights: nothing gets that far)."""
    root = tmp_path_factory.mktemp("newcomer")
    (root / "sokoban.yaml").write_text(SOKOBAN)
    (root / "math_tools.yaml").write_text(MATH_TOOLS)
    tiny = Path(resolve_model_path("builtin:tiny"))
    for name in ("no_template", "no_tools"):
        (root / name).mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / f, root / name / f)
    (root / "no_tools" / "chat_template.jinja").write_text(NO_TOOLS_TEMPLATE)
    return root


def test_model_path_that_does_not_exist(work: Path) -> None:
    res = agentrl("train", "sokoban.yaml", "model.path=./no_such_model", cwd=work)
    assert_one_line_error(res, "model.path: ./no_such_model does not exist", "set model.path to", "builtin:tiny")
    assert "Traceback" not in res.stderr
    verbose = agentrl("train", "sokoban.yaml", "model.path=./no_such_model", "--verbose", cwd=work)
    lines = verbose.stderr.strip().splitlines()
    assert verbose.returncode == 2 and lines[0] == "Traceback (most recent call last):", verbose.stderr
    assert lines[-1] == res.stderr.strip()  # the same line, after the traceback
    before = agentrl("--verbose", "train", "sokoban.yaml", "model.path=./no_such_model", cwd=work)
    assert before.returncode == 2 and before.stderr == verbose.stderr


def test_model_without_a_chat_template(work: Path) -> None:
    res = agentrl("train", "sokoban.yaml", "model.path=./no_template", cwd=work)
    assert_one_line_error(res, "model.path: ./no_template has no chat template", "chat_template.jinja")


def test_chat_template_that_cannot_render_tool_calls(work: Path) -> None:
    res = agentrl("train", "math_tools.yaml", "model.path=./no_tools", cwd=work)
    assert_one_line_error(res, "model.path:", "./no_tools", "tools", "use a model whose chat template supports tools")


def test_gpu_platform_on_a_cpu_machine(work: Path) -> None:
    cpu_only = {"CUDA_VISIBLE_DEVICES": "", "RAY_ADDRESS": "local", "AGENTRL_PLATFORM": None}
    local = "model.path=./no_template"  # the platform is checked first; a local model skips building builtin:tiny
    res = agentrl("train", "sokoban.yaml", "platform=cuda", local, cwd=work, env=cpu_only)
    assert_one_line_error(res, "platform is cuda", "no CUDA GPU", "set platform: auto (or cpu)")
    forced = agentrl("train", "sokoban.yaml", local, cwd=work, env={**cpu_only, "AGENTRL_PLATFORM": "cuda"})
    assert_one_line_error(forced, "AGENTRL_PLATFORM is cuda", "unset AGENTRL_PLATFORM")


def test_serve_tools_on_a_port_in_use(work: Path) -> None:
    (work / "tools.yaml").write_text("sets:\n  math:\n    calculator: {python: agentrl.tools.calculator:calculator}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = agentrl("serve-tools", "tools.yaml", "--port", str(port), cwd=work)
    assert_one_line_error(res, f"port {port} on 127.0.0.1 is already in use", "--port N")
