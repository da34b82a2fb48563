"""Rollout engines (vLLM, SGLang, remote HTTP), the router over them, and resumable generation."""

from agentrl.rollout.base import EngineDeadError, EngineError, RetryableEngineError, RolloutEngine

__all__ = ["EngineDeadError", "EngineError", "RetryableEngineError", "RolloutEngine"]
