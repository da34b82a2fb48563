"""Sokoban state, rendering and parsing: the one place that knows the grid symbols.

Cells are flat indices `row * width + col`, so the solver and the env can use integer arithmetic and
bitmasks. `parse_grid(render(state))` gives the state back, which lets tools solve what the model sees.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIONS = ("Up", "Down", "Left", "Right")
_DIRECTIONS = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}

# Symbol order: wall, floor, target, box, box on target, player, player on target.
SYMBOL_SETS = {
    "default": "#_OX√PS",
    "xsb": "#-.$*@+",  # the classic Sokoban file format (floor written as '-')
}


@dataclass(frozen=True)
class SokobanState:
    """An immutable Sokoban position. `walls` include the outer ring; `boxes` and `targets` are cell sets."""

    height: int
    width: int
    walls: frozenset[int]
    targets: frozenset[int]
    boxes: frozenset[int]
    player: int

    def delta(self, action: str) -> int:
        """Index offset of one move in direction `action`."""
        dr, dc = _DIRECTIONS[action]
        return dr * self.width + dc

    @property
    def solved(self) -> bool:
        return self.boxes <= self.targets


def symbol_table(symbols: str) -> str:
    """Resolve a vocabulary name ("default", "xsb") or an explicit 7-character string."""
    table = SYMBOL_SETS.get(symbols, symbols)
    if len(table) != 7 or len(set(table)) != 7:
        raise ValueError(
            f"symbols must be one of {sorted(SYMBOL_SETS)} or 7 distinct characters "
            f"(wall, floor, target, box, box on target, player, player on target); got {symbols!r}"
        )
    return table


def render(state: SokobanState, symbols: str = "default") -> str:
    """The grid as text, one row per line."""
    wall, floor, target, box, box_on, player, player_on = symbol_table(symbols)
    rows = []
    for r in range(state.height):
        row = []
        for i in range(r * state.width, (r + 1) * state.width):
            on_target = i in state.targets
            if i in state.walls:
                row.append(wall)
            elif i == state.player:
                row.append(player_on if on_target else player)
            elif i in state.boxes:
                row.append(box_on if on_target else box)
            else:
                row.append(target if on_target else floor)
        rows.append("".join(row))
    return "\n".join(rows)


def _grid_rows(text: str, table: str) -> list[str]:
    allowed = set(table)
    return [line.strip() for line in text.splitlines() if line.strip() and set(line.strip()) <= allowed]


def parse_grid(text: str, symbols: str | None = None) -> SokobanState:
    """Parse a rendered grid (lines made only of grid symbols; other lines are ignored).

    With `symbols=None` the vocabulary is detected (the one whose grid has exactly one player). A grid
    without an outer wall ring gets one, so the solver never walks off the board.
    """
    tables = [symbol_table(symbols)] if symbols is not None else list(SYMBOL_SETS.values())
    for table in tables:
        rows = _grid_rows(text, table)
        if sum(row.count(table[5]) + row.count(table[6]) for row in rows) == 1:
            return _state_from_rows(rows, table)
    raise ValueError("no Sokoban grid with exactly one player found in the text")


def _state_from_rows(rows: list[str], table: str) -> SokobanState:
    wall, _floor, target, box, box_on, player, player_on = table
    width = max(len(r) for r in rows)
    rows = [r.ljust(width, wall) for r in rows]
    border = rows[0] + rows[-1] + "".join(r[0] + r[-1] for r in rows)
    if set(border) != {wall}:
        rows = [wall * (width + 2)] + [wall + r + wall for r in rows] + [wall * (width + 2)]
        width += 2
    cells = "".join(rows)
    walls = frozenset(i for i, c in enumerate(cells) if c == wall)
    targets = frozenset(i for i, c in enumerate(cells) if c in (target, box_on, player_on))
    boxes = frozenset(i for i, c in enumerate(cells) if c in (box, box_on))
    pos = next(i for i, c in enumerate(cells) if c in (player, player_on))
    return SokobanState(len(rows), width, walls, targets, boxes, pos)
