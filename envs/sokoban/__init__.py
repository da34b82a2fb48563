"""Sokoban, written here (no gym-sokoban): generator, BFS solver, rendering/parsing and the text env.

`from agentrl.envs.sokoban import parse_grid, solve` then `solve(parse_grid(observation))` plans from what the
model sees.
"""

from agentrl.envs.sokoban.generator import Level, generate_level
from agentrl.envs.sokoban.level import ACTIONS, SYMBOL_SETS, SokobanState, parse_grid, render
from agentrl.envs.sokoban.solver import solve

__all__ = [
    "ACTIONS",
    "SYMBOL_SETS",
    "Level",
    "SokobanState",
    "generate_level",
    "parse_grid",
    "render",
    "solve",
]
