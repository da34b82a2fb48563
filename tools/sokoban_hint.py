"""Built-in `sokoban_hint`: the BFS solver's next move for a grid, for tool-use experiments on Sokoban.

The Sokoban module is imported on first call, so loading the tool package never depends on the env package.
The search is bounded (`MAX_STATES`) so a hard or huge grid gives "no hint" instead of a stuck worker.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from agentrl.tools.core import tool

MAX_STATES = 200_000


@tool
def sokoban_hint(grid: Annotated[str, Field(min_length=1, max_length=4000)]) -> str:
    """Return the next move (Up, Down, Left or Right) of a shortest solution of a Sokoban grid.

    Args:
        grid: the grid exactly as the game shows it, one row per line ("#" wall, "_" floor, "P" player,
            "X" box, "O" target; the xsb symbols #-@$.*+ also work).
    """
    from agentrl.envs.sokoban import parse_grid, solve

    state = parse_grid(grid)  # ValueError (shown to the model) if no grid with one player is found
    plan = solve(state, max_states=MAX_STATES)
    if plan is None:
        return "No hint: this position cannot be solved (a box is stuck) or is too hard to search."
    if not plan:
        return "Already solved."
    return f"{plan[0]} ({len(plan)} moves to solve)"
