"""Sokoban level generation by reverse play: solvable by construction, then BFS-checked for optimal length.

Start from a solved room (boxes on targets), walk the player randomly and sometimes pull a box along: every
reached position can be solved by replaying the pulls as pushes. The level keeps the BFS-optimal plan, and
only levels whose optimal length lies in [min_solution_steps, max_solution_steps] are accepted.

Deterministic per seed in any process or thread (a `random.Random(seed)` instance, no global state besides
an LRU cache of finished levels, which is what keeps generation out of the training loop's time).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from agentrl.envs.sokoban.level import SokobanState
from agentrl.envs.sokoban.solver import solve


@dataclass(frozen=True)
class Level:
    """A generated puzzle and one BFS-optimal solution for it."""

    state: SokobanState
    solution: tuple[str, ...]


@functools.lru_cache(maxsize=16384)
def generate_level(
    seed: int,
    dim_room: tuple[int, int] = (6, 6),
    num_boxes: int = 1,
    inner_walls: tuple[int, int] = (0, 3),
    search_depth: int = 60,
    min_solution_steps: int = 2,
    max_solution_steps: int = 15,
    max_attempts: int = 2000,
) -> Level:
    """The level for `seed` (cached). Raises ValueError if the settings admit no level."""
    height, width = dim_room
    if height < 3 or width < 3:
        raise ValueError(f"dim_room must be at least 3x3, got {dim_room}")
    rng = random.Random(seed)
    for _ in range(max_attempts):
        walls = _room(rng, height, width, inner_walls)
        floor = [i for i in range(height * width) if i not in walls]
        if len(floor) < num_boxes + 1:
            continue
        start = _reverse_play(rng, height, width, walls, floor, num_boxes, search_depth)
        if start is None:
            continue
        plan = solve(start)
        if plan is not None and min_solution_steps <= len(plan) <= max_solution_steps:
            return Level(start, tuple(plan))
    raise ValueError(
        f"no Sokoban level found in {max_attempts} attempts for dim_room={dim_room}, num_boxes={num_boxes}, "
        f"solution length in [{min_solution_steps}, {max_solution_steps}]"
    )


def _room(rng: random.Random, height: int, width: int, inner_walls: tuple[int, int]) -> frozenset[int]:
    """Outer wall ring plus a few random inner walls that keep the floor connected."""
    border = {r * width + c for r in range(height) for c in range(width) if r in (0, height - 1) or c in (0, width - 1)}
    interior = [i for i in range(height * width) if i not in border]
    count = min(rng.randint(*inner_walls), max(len(interior) - 2, 0))
    walls = border | set(rng.sample(interior, count))
    return frozenset(walls) if _connected(walls, interior, width) else frozenset(border)


def _connected(walls: set[int], interior: list[int], width: int) -> bool:
    floor = [i for i in interior if i not in walls]
    seen = {floor[0]}
    todo = [floor[0]]
    while todo:
        i = todo.pop()
        for j in (i - width, i + width, i - 1, i + 1):
            if j not in walls and j not in seen:
                seen.add(j)
                todo.append(j)
    return len(seen) == len(floor)


def _reverse_play(
    rng: random.Random,
    height: int,
    width: int,
    walls: frozenset[int],
    floor: list[int],
    num_boxes: int,
    depth: int,
) -> SokobanState | None:
    """A random walk from the solved position that pulls whatever box is behind the player; returns the
    position with all boxes off target that scores highest on `_difficulty`."""
    picks = rng.sample(floor, num_boxes + 1)
    targets = frozenset(picks[:num_boxes])
    boxes = set(targets)
    player = picks[-1]
    deltas = (-width, width, -1, 1)
    best, best_score = None, 0
    for _ in range(depth):
        d = rng.choice(deltas)
        ahead, behind = player + d, player - d
        if ahead in walls or ahead in boxes:
            continue
        if behind in boxes:
            boxes.remove(behind)
            boxes.add(player)
        player = ahead
        score = _difficulty(boxes, targets, player, width)
        if score > best_score and not boxes & targets:
            best, best_score = SokobanState(height, width, walls, targets, frozenset(boxes), player), score
    return best


def _difficulty(boxes: set[int], targets: frozenset[int], player: int, width: int) -> int:
    """Cheap proxy for solution length: twice the boxes' distance to the nearest targets plus the player's
    distance to the nearest box (without the player term most 1-box levels need only 2 moves)."""

    def dist(a: int, b: int) -> int:
        return abs(a // width - b // width) + abs(a % width - b % width)

    pushes = sum(min(dist(b, t) for t in targets) for b in boxes)
    return 2 * pushes + min(dist(player, b) for b in boxes)
