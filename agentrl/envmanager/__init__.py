"""Env managers: concurrent multi-turn episodes, token-exact history, tool calls, samples."""
