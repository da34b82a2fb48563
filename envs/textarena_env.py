"""`textarena/<game>`: TextArena's games as text envs, the policy in one seat against a fixed opponent.

The game's own text is the observation (TextArena's log for the policy's seat: the rules, the board, the moves so
far; `observation: new` gives only what is new since the policy's last turn, for trajectory-wise samples), the
model's text is the move as TextArena reads it (e.g. `[4]`), and the game's own result is the reward at the end
(+1 win, 0 draw, -1 loss in two-player games; the game's score in one-player ones), TextArena's invalid-move rules
included. The opponent plays its turns inside `step`: `random` plays a random move in the game's format (one
TextArena lists as available, where it lists them), `expert` plays a perfect game (TicTacToe, Nim), `snapshot:PATH`
is a frozen policy snapshot (a model folder, `agentrl.envs.snapshot_opponent`; it sees its seat's text as the policy
sees its own), or `module:function` takes `(observation, rng)` and returns a move. Metrics: success (a positive
result), win / draw / loss, and invalid_move for the policy.

Self-play (`envs.train.TAG.self_play`): both seats of a two-player game are played by the policy. Each game is two
episodes, one per seat, that share one TextArena game through a `SelfPlayTable` (named by the `table` kwarg the
env manager sets): a seat's `astep` plays its move, then waits on the event loop (no thread held) until the other
seat has moved or the game is over; each seat's reward and metrics are its own.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import random
import re
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from agentrl.envs.base import Move, TextEnv
from agentrl.envs.libraries import quiet
from agentrl.envs.library_errors import offline_data_error
from agentrl.plugins import import_object

PREFIX = "textarena/"
SNAPSHOT = "snapshot:"  # opponent: a frozen policy snapshot (agentrl.envs.snapshot_opponent)
_AVAILABLE = re.compile(r"Available Moves: (.*)")
_MOVE = re.compile(r"'(\[[^\]]*\])'")


_PILE = re.compile(r"pile (\d+): (\d+)")


def _random_nim(observation: str, rng: random.Random) -> str:
    piles = [(int(i), int(n)) for i, n in _PILE.findall(observation.rsplit("Current Pile", 1)[-1]) if int(n) > 0]
    pile, size = rng.choice(piles) if piles else (0, 1)
    return f"[{pile} {rng.randint(1, size)}]"


# Random moves in each game's own move format (the games that list their available moves need no entry).
RANDOM_MOVES: dict[str, Callable[[str, random.Random], str]] = {
    "ConnectFour-v0": lambda obs, rng: f"[col {rng.randint(0, 6)}]",
    "Nim-v0": _random_nim,
    "GuessTheNumber-v0": lambda obs, rng: f"[{rng.randint(1, 20)}]",
    "Mastermind-v0": lambda obs, rng: "[" + " ".join(map(str, rng.sample(range(1, 7), 4))) + "]",
}


_TTT_ORDER = (4, 0, 2, 6, 8, 1, 3, 5, 7)  # the expert's tie-break among equally good cells: centre, corners, edges
_TTT_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def _ttt_moves(cells: tuple[str, ...], mark: str) -> list[tuple[int, int]]:
    """(value, cell) of each free cell for `mark` to move: 10 for a win now, less for a win later (sooner is better),
    0 for a draw, negative for a loss (later is less bad); in tie-break order."""
    other = "X" if mark == "O" else "O"
    moves = []
    for cell in _TTT_ORDER:
        if cells[cell]:
            continue
        after = (*cells[:cell], mark, *cells[cell + 1 :])
        if any(all(after[i] == mark for i in line) for line in _TTT_LINES):
            value = 10
        elif all(after):
            value = 0
        else:
            value = -_ttt_value(after, other)
            value -= (value > 0) - (value < 0)
        moves.append((value, cell))
    return moves


@functools.cache
def _ttt_value(cells: tuple[str, ...], mark: str) -> int:
    return max(value for value, _ in _ttt_moves(cells, mark))


def tictactoe_expert(board: list[list[str]], mark: str) -> str:
    """A perfect Tic Tac Toe move for `mark` (minimax; centre, corners, edges on ties), as `[cell]`."""
    moves = _ttt_moves(tuple(c for row in board for c in row), mark)
    return f"[{max(moves, key=lambda m: m[0])[1]}]" if moves else "[0]"


def nim_expert(piles: list[int]) -> str:
    """The winning Nim move (leave a zero nim-sum; last object wins), or one object off the largest pile when the
    position is lost, as `[pile quantity]`."""
    nim_sum = functools.reduce(operator.xor, piles, 0)
    if nim_sum:
        for pile, size in enumerate(piles):
            if size ^ nim_sum < size:
                return f"[{pile} {size - (size ^ nim_sum)}]"
    pile = max(range(len(piles)), key=lambda i: piles[i])
    return f"[{pile} 1]"


def _game_state(env: Any) -> tuple[dict, int]:
    """The state of a TextArena game under its wrappers, and the player to move."""
    while hasattr(env, "env"):
        env = env.env
    return env.state.game_state, env.state.current_player_id


def expert_move(game: str, env: Any) -> str | None:
    """The expert's move in `game` for the player to move (read from the game's state), or None for games without
    one: a perfect player for TicTacToe and Nim."""
    if game == "TicTacToe-v0":
        state, player = _game_state(env)
        return tictactoe_expert(state["board"], "X" if player == 1 else "O")
    if game == "Nim-v0":
        return nim_expert(list(_game_state(env)[0]["piles"]))
    return None


EXPERT_GAMES = ("TicTacToe-v0", "Nim-v0")


def random_move(game: str, observation: str, rng: random.Random) -> str:
    """A random move of `game`: one of those TextArena lists as available, else one in the game's move format."""
    lists = _AVAILABLE.findall(observation)
    moves = _MOVE.findall(lists[-1]) if lists else []
    if moves:
        return rng.choice(moves)
    return RANDOM_MOVES[game](observation, rng) if game in RANDOM_MOVES else "[0]"


class TextArenaEnv(TextEnv):
    contract = frozenset()  # TextArena logs an invalid move and judges it by its own rules

    def __init__(
        self,
        game: str,
        opponent: str = "random",
        seat: int = 0,
        num_players: int = 2,
        observation: str = "full",
        max_steps: int = 30,
        table: str | None = None,
        wait_s: float = 600.0,
        **text_kwargs: Any,
    ) -> None:
        """`table`: self-play, this seat of the game the episodes naming the same table share (the other seats
        are played by their own episodes; `opponent` is unused); `wait_s` bounds the wait for them."""
        super().__init__(max_steps=max_steps, **text_kwargs)
        with quiet():
            import textarena  # its games try nltk downloads on import: offline, their noise is not ours to print

        if observation not in ("full", "new"):
            raise ValueError(f"observation must be 'full' or 'new', not {observation!r}")
        if not 0 <= seat < num_players:
            raise ValueError(f"seat {seat} is not one of the {num_players} players")
        self.textarena, self.game, self.seat, self.num_players = textarena, game, seat, num_players
        self.full = observation == "full"
        self.opponent = self._opponent(opponent) if table is None else None
        self.snapshot_sees_new = opponent.startswith(SNAPSHOT) and not self.full
        self._result: dict[str, float] = {}
        self.env = self._make()  # at construction: a game that needs data from the network says so before any run
        self.table = SelfPlayTable.join(table, num_players) if table is not None else None
        self.wait_s = wait_s
        self._abandoned = False  # self-play: the other seat's episode ended before the game did

    def _make(self) -> Any:
        """A fresh game; data it cannot fetch (nltk corpora, offline) is one line naming what to download."""
        try:
            with quiet():  # nltk's download attempts
                return self.textarena.make(self.game)
        except LookupError as err:
            raise offline_data_error(f"textarena/{self.game}", err) from None

    def _opponent(self, spec: str) -> Callable[[str, random.Random], str]:
        if spec == "random":
            return lambda observation, rng: random_move(self.game, observation, rng)
        if spec == "expert":
            if self.game not in EXPERT_GAMES:
                raise ValueError(f"textarena/{self.game} has no expert opponent (games with one: {EXPERT_GAMES})")
            return lambda observation, rng: expert_move(self.game, self.env) or "[0]"
        if spec.startswith(SNAPSHOT):
            from agentrl.envs.snapshot_opponent import SnapshotOpponent

            return SnapshotOpponent(spec.removeprefix(SNAPSHOT), self.system_prompt())
        if ":" not in spec:
            raise ValueError(f"opponent must be 'random', 'expert', snapshot:PATH or module:function, not {spec!r}")
        return import_object(spec)

    def system_prompt(self) -> str:
        return "You are playing a game. Reply with your move exactly as the game asks for it."

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        self.env = self._make()
        self.env.reset(num_players=self.num_players, seed=seed)
        self.rng = random.Random(seed)
        self._result, self._shown, self._text = {}, 0, ""
        self._opponent_shown: dict[int, int] = {}
        self._play_others()

    def _play_others(self) -> bool:
        """Opponents move until it is the policy's turn or the game is over; True when it is over."""
        while True:
            player, text = self.env.get_observation()
            if player == self.seat:
                self._text = text
                return False
            shown = self._opponent_shown.get(player, 0) if self.snapshot_sees_new else 0
            self._opponent_shown[player] = len(text)  # a snapshot sees its seat's text as the policy sees its own
            done, _ = self.env.step(self.opponent(text[shown:], self.rng))
            if done:
                return self._finish()

    def _finish(self) -> bool:
        rewards, info = self.env.close()
        return self._finish_with(rewards, info)

    def _finish_with(self, rewards: dict | None, info: dict | None) -> bool:
        mine = float(rewards.get(self.seat, 0.0)) if rewards else 0.0
        invalid = bool((info or {}).get(self.seat, {}).get("invalid_move", False))
        self._result = {"reward": mine, "win": float(mine > 0), "draw": float(mine == 0), "loss": float(mine < 0),
                        "invalid_move": float(invalid)}  # fmt: skip
        return True

    def _observation(self) -> str:
        if self._result:
            return f"Game over: {'won' if self._result['win'] else 'draw' if self._result['draw'] else 'lost'}."
        text = self._text if self.full else self._text[self._shown :]
        self._shown = len(self._text)
        return text

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """The model's text goes to the game as is (TextArena parses and judges moves itself)."""
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}.step expects model output text, got {type(action).__name__}")
        before = len(self._text)
        done, _ = self.env.step(action)
        over = self._finish() if done else self._play_others()
        self.turns += 1
        truncated = not over and self.turns >= self.max_steps
        reward = self._result.get("reward", 0.0)
        metrics = self._move_metrics(over, before)
        return self._observation(), reward, over, truncated, {"metrics": metrics, "task": {"game": self.game}}

    def _move_metrics(self, over: bool, before: int) -> dict[str, float]:
        """The policy's move judged: TextArena announces an invalid one in the log after `before` (a retry, or the
        end of the game); at the end, the result's win / draw / loss / invalid_move."""
        valid = not over and "invalid move" not in self._text[before:].lower()
        metrics = {"success": float(self._result.get("win", 0.0)), "action_is_valid": float(valid)}
        if over:
            metrics.update({k: v for k, v in self._result.items() if k != "reward"})
            metrics["action_is_valid"] = 1.0 - self._result["invalid_move"]
        metrics["action_is_effective"] = metrics["action_is_valid"]
        return metrics

    # ---- self-play: the episode runner awaits these instead of reset / step when the env has them --------------
    async def areset(self, *, seed: int | None = None) -> tuple[str, dict]:
        if self.table is None:
            return self.reset(seed=seed)
        self.turns, self._result, self._shown, self._text = 0, {}, 0, ""
        self.env = await self.table.start(self._make, seed or 0)
        obs = await self._my_turn()
        if self._abandoned:
            raise RuntimeError(f"self-play table {self.table.name}: the other seat's episode ended first")
        info: dict[str, Any] = {"seed": seed, "task": {"game": self.game, "seat": self.seat}}
        if self._result:  # the game ended before this seat's first move (the other seat's invalid moves)
            metrics = {k: v for k, v in self._result.items() if k != "reward"}
            info.update(terminated=True, reward=self._result["reward"],
                        metrics={**metrics, "success": self._result["win"]})  # fmt: skip
        return obs, info

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.table is None:
            return self.step(action)
        before = len(self._text)
        self.table.play(self.seat, action)
        self.turns += 1
        obs = await self._my_turn()
        over = bool(self._result)
        truncated = not over and (self.turns >= self.max_steps or self._abandoned)
        metrics = self._move_metrics(over, before)
        task = {"game": self.game, "seat": self.seat}
        return obs, self._result.get("reward", 0.0), over, truncated, {"metrics": metrics, "task": task}

    async def aclose(self) -> None:
        """The episode ended (done, truncated or failed): the other seat stops waiting for this one."""
        if self.table is not None:
            self.table.leave(self.seat)

    async def _my_turn(self) -> str:
        """Wait until this seat is to move (its observation) or the game is over (its result)."""
        outcome = await self.table.wait(self.seat, self.wait_s)
        if outcome is None:
            self._text = self.env.get_observation()[1]
            return self._observation()
        if outcome == "left":
            self._abandoned = True
            return "The other player left: the game ends without a result."
        rewards, info = outcome
        self._finish_with(rewards, info)
        return self._observation()

    # the base class's hooks, unused: this env hands the text to the game itself
    def _canonical_action(self, text: str) -> str | None:
        return text

    def _apply(self, action: str) -> Move:
        raise NotImplementedError

    def _is_success(self) -> bool:
        return bool(self._result.get("win"))

    def _random_move(self, rng: random.Random) -> str:
        return random_move(self.game, self._text, rng)

    def random_action(self, rng: random.Random) -> str:
        return random_move(self.game, self._text, rng)

    def expert_action(self) -> str | None:
        """The expert's move as the model would write it (TextArena reads the text itself), for the SFT warm start;
        None for games without an expert or once the game is over."""
        return None if self._result else expert_move(self.game, self.env)


class SelfPlayTable:
    """One TextArena game shared by the episodes that play its seats (all on one env manager's event loop). The
    first seat to arrive makes and resets the game; each move wakes the seats; the game's close is read once and
    handed to every seat. A seat that leaves early (its episode failed or hit its turn limit) ends the others'."""

    _open: ClassVar[dict[str, SelfPlayTable]] = {}
    # envs are built on env threads; the game is played on the event loop
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str, seats: int) -> None:
        self.name, self.seats, self.present = name, seats, 0
        self.game: Any = None
        self.result: tuple[dict, dict] | None = None
        self.left = False
        self._moved: asyncio.Condition | None = None

    @classmethod
    def join(cls, name: str, seats: int) -> SelfPlayTable:
        with cls._lock:
            table = cls._open.setdefault(name, cls(name, seats))
            table.present += 1
            return table

    async def start(self, make: Callable[[], Any], seed: int) -> Any:
        if self._moved is None:
            self._moved = asyncio.Condition()
        if self.game is None:
            self.game = make()
            self.game.reset(num_players=self.seats, seed=seed)
        return self.game

    def play(self, seat: int, action: str) -> None:
        player, _ = self.game.get_observation()
        if player != seat or self.result is not None or self.left:
            raise RuntimeError(f"seat {seat} moved out of turn at table {self.name}")
        done, _ = self.game.step(action)
        if done:
            self.result = self.game.close()
        self._wake()

    def leave(self, seat: int) -> None:
        with self._lock:
            self.present -= 1
            if self.present <= 0:
                self._open.pop(self.name, None)
        if self.result is None:
            self.left = True
        self._wake()

    def _wake(self) -> None:
        if self._moved is not None:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._moved:
            self._moved.notify_all()

    async def wait(self, seat: int, timeout_s: float) -> tuple[dict, dict] | str | None:
        """None when `seat` is to move; the game's (rewards, info) when it is over; "left" when another seat left."""

        def ready() -> bool:
            return self.result is not None or self.left or self.game.get_observation()[0] == seat

        async with self._moved:
            await asyncio.wait_for(self._moved.wait_for(ready), timeout_s)
        if self.result is not None:
            return self.result
        return "left" if self.left else None


# game -> players. Wordle and Hangman need nltk corpora that TextArena downloads on first use: offline, building
# them is a one-line error naming the data.
GAMES = {"TicTacToe-v0": 2, "ConnectFour-v0": 2, "Nim-v0": 2, "GuessTheNumber-v0": 1, "Mastermind-v0": 1,
         "Wordle-v0": 1, "Hangman-v0": 1}  # fmt: skip


def register() -> list[str]:
    """Register `textarena/<game>` for TextArena's games that run offline here (Wordle and Hangman fetch nltk data)."""
    from agentrl.envs.registry import register_env

    ids = []
    for game, players in GAMES.items():
        register_env(f"{PREFIX}{game}", f"{__name__}:TextArenaEnv", game=game, num_players=players)
        ids.append(f"{PREFIX}{game}")
    return ids
