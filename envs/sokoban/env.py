"""`SokobanEnv`: the text Sokoban env (the default training env is its 6x6, 1-box preset)."""

from __future__ import annotations

import random
from typing import Any

from agentrl.envs.base import Move, TextEnv
from agentrl.envs.sokoban.generator import Level, generate_level
from agentrl.envs.sokoban.level import ACTIONS, SokobanState, parse_grid, render, symbol_table
from agentrl.envs.sokoban.solver import solve

_ACTION_BY_NAME = {a.lower(): a for a in ACTIONS}


class SokobanEnv(TextEnv):
    """Push every box onto a target. Observation: the grid only (short prompts suit tiny models), and with
    `mark_revisits` a line "(visit k)" under a position shown for the k-th time this episode: a policy that sees
    only the grid is Markov, so once greedy play revisits a position (a move into a wall, a step back and forth)
    it loops until the turn limit; the mark makes the repeated prompt differ, so the policy can learn to leave.

    Rewards: `step_penalty` (-0.1) per move, +1 for a box onto a target, -1 for a box off one, +10 when
    solved; unparsable output adds `format_penalty` and moves nothing. Levels come from reverse play
    (see generator.py) and are cached per (seed, settings); `reset(options={"grid": text})` plays a given
    grid instead. `info` at reset carries the BFS-optimal number of
    moves and the return of that optimal play.
    """

    inline_step = True  # a step parses the answer, moves and renders the grid: ~60 us of pure Python

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        inner_walls: tuple[int, int] = (0, 3),
        search_depth: int = 60,
        min_solution_steps: int = 2,
        max_solution_steps: int | None = None,
        max_steps: int = 15,
        symbols: str = "default",
        step_penalty: float = -0.1,
        box_on_target_reward: float = 1.0,
        solve_reward: float = 10.0,
        mark_revisits: bool = False,
        **text_kwargs: Any,
    ) -> None:
        super().__init__(max_steps=max_steps, **text_kwargs)
        self.level_kwargs = {
            "dim_room": tuple(int(x) for x in dim_room),
            "num_boxes": int(num_boxes),
            "inner_walls": tuple(int(x) for x in inner_walls),
            "search_depth": int(search_depth),
            "min_solution_steps": int(min_solution_steps),
            "max_solution_steps": int(max_solution_steps if max_solution_steps is not None else max_steps),
        }
        self.symbols = symbol_table(symbols)
        self.step_penalty = float(step_penalty)
        self.box_on_target_reward = float(box_on_target_reward)
        self.solve_reward = float(solve_reward)
        self.mark_revisits = bool(mark_revisits)
        self._visits: dict[tuple[int, frozenset[int]], int] = {}
        self._counted_turn = -1
        self._plan: list[str] = []
        self._plan_key: tuple[int, frozenset[int]] | None = None

    # ---- prompt ---------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        wall, floor, target, box, box_on, player, player_on = self.symbols
        many = self.parser.max_actions > 1
        example = self.parser.format(["Up", "Left"] if many else ["Up"])
        count = f"up to {self.parser.max_actions} moves" if many else "one move"
        return (
            f"Sokoban: push each box {box} onto a target {target}.\n"
            f"{wall} wall {floor} floor {box_on} box on target {player} you {player_on} you on target\n"
            f"Answer {count} (Up, Down, Left or Right): {example}"
        )

    def _observation(self) -> str:
        grid = render(self.state, self.symbols)
        if not self.mark_revisits:
            return grid
        if self._counted_turn != self.turns:  # once per turn: render() on the same turn does not count again
            self._counted_turn = self.turns
            self._visits[self._key()] = self._visits.get(self._key(), 0) + 1
        visits = self._visits[self._key()]
        return grid if visits == 1 else f"{grid}\n(visit {visits})"

    # ---- dynamics -------------------------------------------------------------------------------------
    @property
    def state(self) -> SokobanState:
        """The current position (immutable snapshot)."""
        return SokobanState(self._height, self._width, self._walls, self._targets, frozenset(self._boxes), self._player)

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        """A generated level, or the one in `options["grid"]` (rendered text: fixed eval sets, tests)."""
        if "grid" in options:
            s = parse_grid(options["grid"])
            solution = solve(s)
            level = Level(s, tuple(solution or ()))
        else:
            level = generate_level(seed, **self.level_kwargs)
            s, solution = level.state, level.solution
        self._height, self._width, self._walls, self._targets = s.height, s.width, s.walls, s.targets
        self._boxes, self._player = set(s.boxes), s.player
        self._deltas = {a: s.delta(a) for a in ACTIONS}
        self._plan, self._plan_key = list(level.solution), self._key()
        self._optimal = None if solution is None else len(solution)
        self._boxes_off_target = len(s.boxes - s.targets)
        self._visits, self._counted_turn = {}, -1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        obs, info = super().reset(seed=seed, options=options)
        info["optimal_steps"] = self._optimal  # None: the given grid is unsolvable
        info["optimal_return"] = None
        if self._optimal is not None:
            rewards = self._boxes_off_target * self.box_on_target_reward + self.solve_reward * (self._optimal > 0)
            info["optimal_return"] = round(self._optimal * self.step_penalty + rewards, 9)
        return obs, info

    def _key(self) -> tuple[int, frozenset[int]]:
        return self._player, frozenset(self._boxes)

    def _canonical_action(self, text: str) -> str | None:
        return _ACTION_BY_NAME.get(text.strip().rstrip(".").lower())

    def _apply(self, action: str) -> Move:
        before = self._key() if self._plan else None
        d = self._deltas[action]
        ahead = self._player + d
        if ahead in self._walls:
            return Move(0.0, False, False)
        reward = 0.0
        if ahead in self._boxes:
            beyond = ahead + d
            if beyond in self._walls or beyond in self._boxes:
                return Move(0.0, False, False)
            self._boxes.remove(ahead)
            self._boxes.add(beyond)
            reward += self.box_on_target_reward * ((beyond in self._targets) - (ahead in self._targets))
        self._player = ahead
        if before is not None and before == self._plan_key and self._plan[0] == action:
            self._plan, self._plan_key = self._plan[1:], self._key()
        solved = self._is_success()
        return Move(reward + (self.solve_reward if solved else 0.0), True, solved)

    def _is_success(self) -> bool:
        return self._boxes <= self._targets

    # ---- agents ---------------------------------------------------------------------------------------
    def _expert_move(self) -> str | None:
        """Next move of a BFS-optimal plan (re-planned only after the agent leaves the plan); None in a dead
        position (a box stuck where no plan exists) or a solved one: there is no move to teach there."""
        key = self._key()
        if key != self._plan_key:
            self._plan, self._plan_key = solve(self.state) or [], key
        return self._plan[0] if self._plan else None

    def _random_move(self, rng: random.Random) -> str:
        return rng.choice(ACTIONS)
