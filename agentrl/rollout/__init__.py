"""Rollout engines (vLLM, SGLang, remote HTTP), the router over them, and resumable generation."""

from agentrl.rollout.base import EngineError, RetryableEngineError, RolloutEngine

__all__ = ["EngineError", "RetryableEngineError", "RolloutEngine"]
