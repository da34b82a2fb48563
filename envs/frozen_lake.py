"""`FrozenLakeEnv`: walk from start to goal without falling into a hole, on a random solvable map per seed."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from agentrl.envs.base import Move, TextEnv

ACTIONS = ("Up", "Down", "Left", "Right")
_DELTAS = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
_PERPENDICULAR = {
    "Up": ("Left", "Right"),
    "Down": ("Left", "Right"),
    "Left": ("Up", "Down"),
    "Right": ("Up", "Down"),
}


class FrozenLakeEnv(TextEnv):
    """Cells: S start, F frozen, H hole, G goal, P you. Reward 1 on reaching the goal, episode ends in a hole.

    Maps are drawn per seed (holes with probability 1 - p_frozen, start and goal anywhere) until the goal is
    reachable. Non-slippery by default; when slippery, a move goes sideways with probability 2/3 (as in
    gymnasium), drawn from a per-episode `random.Random(seed)`.
    """

    def __init__(
        self,
        size: int = 4,
        p_frozen: float = 0.8,
        is_slippery: bool = False,
        max_steps: int = 20,
        goal_reward: float = 1.0,
        **text_kwargs: Any,
    ) -> None:
        super().__init__(max_steps=max_steps, **text_kwargs)
        if size < 2 or not 0.0 < p_frozen <= 1.0:
            raise ValueError(f"need size >= 2 and 0 < p_frozen <= 1, got size={size}, p_frozen={p_frozen}")
        self.size, self.p_frozen, self.is_slippery = int(size), float(p_frozen), bool(is_slippery)
        self.goal_reward = float(goal_reward)

    def system_prompt(self) -> str:
        slip = " The ice is slippery: you may slide sideways." if self.is_slippery else ""
        return (
            "FrozenLake: walk to the goal G without stepping into a hole H.\n"
            f"S start, F frozen ice, H hole, G goal, P you.{slip}\n"
            f"Answer with one move (Up, Down, Left or Right), e.g. {self.parser.format(['Up'])}"
        )

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        rng = random.Random(seed)
        n = self.size
        while True:
            start, goal = rng.sample([(r, c) for r in range(n) for c in range(n)], 2)
            grid = [["F" if rng.random() < self.p_frozen else "H" for _ in range(n)] for _ in range(n)]
            grid[start[0]][start[1]], grid[goal[0]][goal[1]] = "S", "G"
            self._grid = grid
            if self._path_from(start) is not None:
                break
        self._pos, self._slip_rng = start, rng

    def _observation(self) -> str:
        rows = [row[:] for row in self._grid]
        rows[self._pos[0]][self._pos[1]] = "P"
        return "\n".join("".join(row) for row in rows)

    def _canonical_action(self, text: str) -> str | None:
        return {a.lower(): a for a in ACTIONS}.get(text.strip().rstrip(".").lower())

    def _target(self, pos: tuple[int, int], action: str) -> tuple[int, int]:
        dr, dc = _DELTAS[action]
        r, c = pos[0] + dr, pos[1] + dc
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else pos

    def _apply(self, action: str) -> Move:
        if self.is_slippery:
            action = self._slip_rng.choice((action, *_PERPENDICULAR[action]))
        new = self._target(self._pos, action)
        effective, self._pos = new != self._pos, new
        cell = self._grid[new[0]][new[1]]
        return Move(self.goal_reward if cell == "G" else 0.0, effective, cell in "GH")

    def _is_success(self) -> bool:
        return self._grid[self._pos[0]][self._pos[1]] == "G"

    def _path_from(self, start: tuple[int, int]) -> list[str] | None:
        """Shortest move list from `start` to the goal avoiding holes (BFS), None if there is none."""
        seen = {start: []}
        todo = deque([start])
        while todo:
            pos = todo.popleft()
            if self._grid[pos[0]][pos[1]] == "G":
                return seen[pos]
            if self._grid[pos[0]][pos[1]] == "H":
                continue
            for a in ACTIONS:
                nxt = self._target(pos, a)
                if nxt not in seen:
                    seen[nxt] = [*seen[pos], a]
                    todo.append(nxt)
        return None

    def _expert_move(self) -> str | None:
        path = self._path_from(self._pos)
        return path[0] if path else ACTIONS[0]

    def _random_move(self, rng: random.Random) -> str:
        return rng.choice(ACTIONS)
