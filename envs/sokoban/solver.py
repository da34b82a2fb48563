"""Breadth-first Sokoban solver: move-optimal plans for tests, expert demonstrations and optimal returns.

States are `boxes_bitmask * cells + player` integers; boxes never enter "dead" cells (from which no push
sequence reaches a target even on an empty board), which prunes only unsolvable states, so plans stay optimal.
"""

from __future__ import annotations

from agentrl.envs.sokoban.level import ACTIONS, SokobanState


def dead_cells(state: SokobanState) -> int:
    """Bitmask of cells a box can never be pushed from onto any target (walls excluded)."""
    n = state.height * state.width
    deltas = [state.delta(a) for a in ACTIONS]
    live = set(state.targets)
    todo = list(state.targets)
    while todo:
        b = todo.pop()
        for d in deltas:  # a push by d moved the box from b - d to b, with the player at b - 2d
            prev, pusher = b - d, b - 2 * d
            if prev in live or not (0 <= pusher < n) or prev in state.walls or pusher in state.walls:
                continue
            live.add(prev)
            todo.append(prev)
    return sum(1 << i for i in range(n) if i not in live and i not in state.walls)


def solve(state: SokobanState, max_states: int = 2_000_000) -> list[str] | None:
    """A shortest list of moves ("Up", "Down", "Left", "Right") that solves `state`, [] if already solved,
    None if unsolvable (or more than `max_states` states would be searched)."""
    n = state.height * state.width
    walls = sum(1 << i for i in state.walls)
    targets = sum(1 << i for i in state.targets)
    dead = dead_cells(state)
    start_mask = sum(1 << i for i in state.boxes)
    if start_mask & ~targets == 0:
        return []
    if start_mask & dead:
        return None
    moves = [(state.delta(a), k) for k, a in enumerate(ACTIONS)]
    start = start_mask * n + state.player
    parent: dict[int, tuple[int, int]] = {start: (-1, -1)}
    frontier = [start]
    while frontier and len(parent) < max_states:
        nxt = []
        for key in frontier:
            mask, p = divmod(key, n)
            blocked = walls | mask | dead
            for d, k in moves:
                q = p + d
                if walls >> q & 1:
                    continue
                if mask >> q & 1:
                    r = q + d
                    if blocked >> r & 1:
                        continue
                    new_mask = mask ^ (1 << q) ^ (1 << r)
                    new_key = new_mask * n + q
                    if new_key in parent:
                        continue
                    parent[new_key] = (key, k)
                    if new_mask & ~targets == 0:
                        return _plan(parent, new_key)
                else:
                    new_key = mask * n + q
                    if new_key in parent:
                        continue
                    parent[new_key] = (key, k)
                nxt.append(new_key)
        frontier = nxt
    return None


def _plan(parent: dict[int, tuple[int, int]], key: int) -> list[str]:
    plan = []
    while True:
        key, k = parent[key]
        if k < 0:
            return plan[::-1]
        plan.append(ACTIONS[k])
