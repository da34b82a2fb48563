"""The OpenEnv wire format, as agentrl speaks it on both sides (server and `agentrl/OpenEnv-v0` client).

Matched against openenv 0.10.0 (`openenv.core.env_server.types` and `serialization.serialize_observation`), the
same format openenv-core 0.3 uses: one WebSocket per session at `/ws`; the client sends
`{"type": "reset", "data": {"seed": ...}}`, `{"type": "step", "data": <action fields>}`, `{"type": "state"}`
or `{"type": "close"}`; the server answers `{"type": "observation", "data": {"observation": {...}, "reward": r,
"done": d, "metadata": {...}}}`, `{"type": "state", "data": {...}}` or `{"type": "error", "data": {"message",
"code"}}`. Text actions travel as `{"message": text}` (OpenEnv's text envs' field) and text observations as
`observation["text"]`.

Why a module instead of the `openenv` package: openenv 0.10 depends on gradio, fastmcp, openai and
huggingface_hub>=1.29 for its CLI and UI, none of which the protocol needs; the messages are a few dicts.

agentrl adds, inside the OpenEnv shapes: `metadata["agentrl"]` (the env's `info`, `terminated`, `truncated`,
`max_steps`) and, on reset, `observation["system_prompt"]`; plus two optional message types that other
OpenEnv servers answer with an UNKNOWN_TYPE error: `agentrl.expert_action` and `agentrl.random_action` (the
checker's agents).
"""

from __future__ import annotations

import json
from typing import Any

OPENENV_VERSION = "0.10.0"  # the openenv release whose message shapes this module follows
ACTION_FIELD = "message"
TEXT_FIELD = "text"
EXPERT = "agentrl.expert_action"
RANDOM = "agentrl.random_action"

# WSErrorCode values of openenv 0.10, plus agentrl's own (the server ends the session after these three).
INVALID_JSON = "INVALID_JSON"
UNKNOWN_TYPE = "UNKNOWN_TYPE"
VALIDATION_ERROR = "VALIDATION_ERROR"
EXECUTION_ERROR = "EXECUTION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"
SESSION_EXPIRED = "SESSION_EXPIRED"
MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
WORKER_RETIRED = "WORKER_RETIRED"


def json_safe(value: Any) -> Any:
    """`value` as plain JSON types (numpy scalars and the like become their str())."""
    return json.loads(json.dumps(value, default=str))


def observation(
    text: str,
    reward: float | None,
    terminated: bool,
    truncated: bool,
    info: dict[str, Any],
    max_steps: int,
    system_prompt: str | None = None,
) -> dict[str, Any]:
    """An observation message's `data`, in serialize_observation's layout (metadata nested and top level)."""
    ours = {"info": json_safe(info), "terminated": terminated, "truncated": truncated, "max_steps": max_steps}
    meta = {"agentrl": ours}
    obs: dict[str, Any] = {TEXT_FIELD: text, "metadata": meta}
    if system_prompt is not None:
        obs["system_prompt"] = system_prompt
    return {"observation": obs, "reward": reward, "done": terminated or truncated, "metadata": meta}


def error(message: str, code: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def message(kind: str, data: dict[str, Any]) -> str:
    return json.dumps({"type": kind, "data": data})


def action_schema() -> dict[str, Any]:
    """JSON schema of a text action (`GET /schema`)."""
    return {
        "title": "TextAction",
        "type": "object",
        "properties": {ACTION_FIELD: {"type": "string", "description": "the model's output for this turn"}},
        "required": [ACTION_FIELD],
        "additionalProperties": False,
    }


def observation_schema() -> dict[str, Any]:
    return {
        "title": "TextObservation",
        "type": "object",
        "properties": {
            TEXT_FIELD: {"type": "string"},
            "system_prompt": {"type": "string"},
            "metadata": {"type": "object"},
            "done": {"type": "boolean"},
            "reward": {"type": ["number", "null"]},
        },
        "required": [TEXT_FIELD],
    }
