"""Checks that need no Ray, run before it starts (`check_before_ray`): seconds saved on every mistake, and one
ConfigError line instead of a long error from every actor. The platform against this machine when the run's Ray is
local, and the chat template of a local model (tool calls and results included when an env has tools)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from agentrl.config import Config, ConfigError
from agentrl.platform import platform_choice


def platform_fix(cfg: Config) -> str:
    """What to change when the run's platform names devices nobody has."""
    if cfg.platform == "auto":  # AGENTRL_PLATFORM forced it
        return "unset AGENTRL_PLATFORM (or set it to cpu) to train on CPU"
    return f"set platform: auto (or cpu) to train on CPU (the config says platform: {cfg.platform})"


def _starts_local_ray(cfg: Config) -> bool:
    """Whether `init_ray(cfg.ray_address)` will start a Ray cluster of this machine alone (no address, no
    RAY_ADDRESS, no cluster left by `ray start` here; or the address "local"), so that this machine's devices are
    the run's. As in `ray.init`, RAY_ADDRESS counts where the config says nothing or "auto"."""
    address = cfg.ray_address
    if address in (None, "auto"):
        address = os.environ.get("RAY_ADDRESS") or address
    if address == "local":  # Ray's word for "start a new local cluster, whatever else runs here"
        return True
    if address:
        return False
    try:
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None) is None
    except Exception:  # Ray's private API moved: don't guess
        return False


def check_local_platform(cfg: Config) -> None:
    """`platform: cuda` / `npu` (or AGENTRL_PLATFORM) on a machine without such a device, for a run that starts its
    own local Ray. A cluster's devices are checked once joined (startup.check_cluster_resources)."""
    kind = platform_choice(cfg.platform)
    if kind not in ("cuda", "npu") or not _starts_local_ray(cfg):
        return
    from agentrl.platform import _probe_cuda, _probe_npu

    if (_probe_cuda() if kind == "cuda" else _probe_npu()) > 0:
        return
    what = "CUDA GPU" if kind == "cuda" else "Ascend NPU"
    where = "platform" if cfg.platform != "auto" else "AGENTRL_PLATFORM"
    raise ConfigError(
        f"{where} is {kind}, but this machine has no {what} and the run starts its own local Ray: "
        f"{platform_fix(cfg)}, or set ray_address to a Ray cluster with {what}s"
    )


# An OpenAI function schema and a tool result that no template writes on its own.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "agentrl_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
_PROBE_RESULT = "agentrl-probe-result-7342"
_TOOLS_FIX = "use a model whose chat template supports tools (e.g. a Qwen2.5 instruct model)"


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


@lru_cache(maxsize=8)
def _template_problem(path: str, shown: str, tools: bool) -> str | None:
    """Why the tokenizer at `path` cannot hold the run's conversations (None when it can)."""
    from transformers import AutoTokenizer

    from agentrl.envmanager.chat import ChatTokens

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # a broken tokenizer folder may fail with anything
        return f"cannot load a tokenizer from {shown}: {_first_line(err)}"
    if not getattr(tok, "chat_template", None):
        return (
            f"{shown} has no chat template (tokenizer_config.json has no chat_template, and there is no "
            "chat_template.jinja): use a chat/instruct model, or add its chat template to the folder as "
            "chat_template.jinja"
        )
    try:
        chat = ChatTokens(tok, [_PROBE_TOOL] if tools else None)
        if not tools:
            return None
        if _PROBE_TOOL["function"]["name"] not in chat._closed:
            return (
                f"the chat template of {shown} ignores the tools list, so the model never sees the tools: {_TOOLS_FIX}"
            )
        tail = tok.decode(chat.delta_ids([{"role": "tool", "content": _PROBE_RESULT}], True))
    except Exception as err:  # jinja's TemplateError, raise_exception(...), a template that is not prefix-stable
        if tools:
            return (
                f"the chat template of {shown} cannot render tool calls and results ({_first_line(err)}): {_TOOLS_FIX}"
            )
        return (
            f"the chat template of {shown} cannot render a conversation ({_first_line(err)}): use a chat/instruct "
            "model whose template renders system, user and assistant turns"
        )
    if _PROBE_RESULT not in tail:
        return f"the chat template of {shown} drops tool results (messages with role 'tool'): {_TOOLS_FIX}"
    return None


def check_chat_template(cfg: Config, model_path: str) -> None:
    """The tokenizer (model.tokenizer, else the model at `model_path`) has a chat template that renders the run's
    conversations, tool calls and results included when an env has tools. Skipped for a path that is no local
    folder (a hub id not downloaded yet: startup.check_before_start checks it once resolved)."""
    key, path = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", model_path)
    if not Path(path).expanduser().is_dir():
        return
    shown = cfg.model.path if key == "model.path" and cfg.model.path.startswith("builtin:") else path
    tools = any(spec.tools for spec in (*cfg.envs.train.values(), *cfg.envs.val.values()))
    problem = _template_problem(str(Path(path).expanduser()), shown, tools)
    if problem is not None:
        raise ConfigError(f"{key}: {problem}")


def check_before_ray(cfg: Config, model_path: str) -> None:
    """Everything checkable before Ray starts. `model_path`: a local folder or a hub id (plan_model_path's)."""
    check_local_platform(cfg)
    check_chat_template(cfg, model_path)
