"""A few episodes per env tag, as a person reads them, in RUN_DIR/episodes/step-NNNNNN.jsonl (`agentrl view`).

Every `logging.sample_every_steps` RL steps the loop picks, per env tag of the batch, the worst and the best
episode and random others up to `logging.sample_episodes` (so failures and successes both show), asks the trainer
for the per-token advantages it gives their samples, and hands them here; every validation hands its held-out
episodes the same way. One line per episode: the `EpisodeRecord` (the chat, per turn its tokens, versions,
reward, done flag), the token texts, and for training episodes each turn's advantages. Files are written by one
thread off the training loop's critical path, in order; when the folder grows past `logging.episodes_max_mb`
every other older file is removed (the newest stays), so a long run keeps an even sample of its history.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agentrl.types import EpisodeRecord, Group, Sample

PICKS = ("worst", "best")  # then "random"


def episodes_dir(run_dir: Path) -> Path:
    return run_dir / "episodes"


def episodes_file(run_dir: Path, step: int) -> Path:
    return episodes_dir(run_dir) / f"step-{step:06d}.jsonl"


def pick(records: Sequence[EpisodeRecord], per_tag: int, seed: int) -> list[tuple[str, EpisodeRecord]]:
    """Per env tag: the lowest-return episode, the highest, then random others, `per_tag` in all; each with why it
    was picked. Seeded by the step, so a resumed run picks as the uninterrupted one would."""
    rng = random.Random(seed)
    by_tag: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        by_tag.setdefault(r.tag, []).append(r)
    chosen: list[tuple[str, EpisodeRecord]] = []
    for tag in sorted(by_tag):
        ranked = sorted(by_tag[tag], key=lambda r: r.episode_return)
        ends = [ranked[0], ranked[-1]] if len(ranked) > 1 else ranked
        picked = list(zip(PICKS, ends, strict=False))[:per_tag]
        rest = ranked[1:-1]
        picked += [("random", r) for r in rng.sample(rest, min(per_tag - len(picked), len(rest)))]
        chosen += picked
    return chosen


def sample_indices(records: Sequence[EpisodeRecord], samples: Sequence[Sample]) -> list[int]:
    """The batch positions of the picked episodes' samples (the advantages the trainer reports for them)."""
    wanted = {r.episode_id for r in records}
    return [i for i, s in enumerate(samples) if s.episode_id in wanted]


def turn_advantages(record: EpisodeRecord, samples: Sequence[tuple[Sample, list[float]]]) -> list[list[float]] | None:
    """Each model turn's per-token advantages, from the episode's samples and the trainer's per-token advantages
    (aligned with each sample's tokens). Trajectory-wise the episode's first sample holds every turn, its model
    tokens in runs, one per turn; turn-wise each turn is its own sample. None when the samples do not hold the
    record's turns token for token (they always should: the test of this module checks it on real runs)."""
    turns = record.turns
    step_wise = {s.turn_index: (s, a) for s, a in samples if s.turn_index is not None}
    if step_wise:
        out = []
        for k, turn in enumerate(turns):
            if k not in step_wise:
                return None
            s, adv = step_wise[k]
            n = len(turn["token_ids"])
            if s.token_ids[len(s.token_ids) - n :] != turn["token_ids"]:
                return None
            out.append(adv[len(adv) - n :])
        return out
    whole = next(((s, a) for s, a in samples if s.turn_index is None), None)
    if whole is None:
        return None
    s, adv = whole
    out, pos = [], 0
    for turn in turns:
        ids = turn["token_ids"]
        while ids and pos < len(s.loss_mask) and not s.loss_mask[pos]:
            pos += 1
        if s.token_ids[pos : pos + len(ids)] != ids or not all(s.loss_mask[pos : pos + len(ids)]):
            return None
        out.append(adv[pos : pos + len(ids)])
        pos += len(ids)
    return out


def advantages_by_episode(
    picked: Sequence[tuple[str, EpisodeRecord]], samples: Sequence[Sample], reported: dict[int, list[float]]
) -> dict[str, list[list[float]] | None]:
    """Each picked episode's per-turn advantages, from the advantages the trainer reported by batch position."""
    by_episode: dict[str, list[tuple[Sample, list[float]]]] = {}
    for i, adv in sorted(reported.items()):
        by_episode.setdefault(samples[i].episode_id, []).append((samples[i], adv))
    return {r.episode_id: turn_advantages(r, by_episode[r.episode_id]) for _, r in picked if r.episode_id in by_episode}


class TokenTexts:
    """Token id -> its text, with the run's tokenizer loaded on first use (on the writer thread) and each id decoded
    once. No tokenizer path (a test's stand-in parts): no token texts."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer: Any = None
        self._texts: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self.path)

    def __call__(self, token_id: int) -> str:
        if token_id not in self._texts:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            self._texts[token_id] = self._tokenizer.decode([token_id])
        return self._texts[token_id]


class EpisodeLog:
    """Writes picked episodes under RUN_DIR/episodes on its own thread; `close()` waits for what is queued."""

    def __init__(
        self,
        run_dir: Path,
        every_steps: int,
        per_tag: int,
        max_mb: float,
        decode: Callable[[int], str] | None = None,
        on_write: Callable[[int, str, list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.every_steps, self.per_tag, self.max_bytes = every_steps, per_tag, int(max_mb * 2**20)
        self.decode = decode  # token id -> its text, for the viewer's per-token colouring
        self.on_write = on_write  # the trackers' copy (MetricsSink.log_episodes), called on the writer thread
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-episodes")

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def pick_batch(self, step: int, groups: Sequence[Group]) -> list[tuple[str, EpisodeRecord]]:
        """The episodes of training step `step` to write ([] when it is not due)."""
        if not self.due(step):
            return []
        return pick([r for g in groups for r in getattr(g, "episodes", ())], self.per_tag, seed=step)

    def write(
        self,
        step: int,
        phase: str,
        picked: Sequence[tuple[str, EpisodeRecord]],
        advantages: dict[str, list[list[float]] | None] | None = None,
    ) -> None:
        """Queue the episodes of `phase` ("train" or "validation") at `step`, with each training episode's
        per-turn advantages (by episode id)."""
        if picked:
            self._writer.submit(self._write, step, phase, list(picked), dict(advantages or {}))

    def _write(self, step: int, phase: str, picked: list[tuple[str, EpisodeRecord]], advantages: dict) -> None:
        lines = [self._line(step, phase, why, r, advantages.get(r.episode_id)) for why, r in picked]
        path = episodes_file(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        self._thin()
        if self.on_write is not None:
            self.on_write(step, phase, lines)

    def _line(
        self, step: int, phase: str, why: str, r: EpisodeRecord, advantages: list[list[float]] | None
    ) -> dict[str, Any]:
        line = {"step": step, "phase": phase, "picked": why, "success": r.success, **asdict(r)}
        for k, turn in enumerate(line["turns"]):
            if self.decode:
                turn["tokens"] = [self.decode(t) for t in turn["token_ids"]]
            if advantages is not None:
                turn["advantages"] = [round(a, 5) for a in advantages[k]]
                turn["advantage"] = sum(advantages[k]) / len(advantages[k]) if advantages[k] else 0.0
        return line

    def _thin(self) -> None:
        files = sorted(episodes_dir(self.run_dir).glob("step-*.jsonl"))
        while len(files) > 1 and sum(f.stat().st_size for f in files) > self.max_bytes:
            older, newest = files[:-1], files[-1]
            dropped = older[1::2] or older
            for f in dropped:
                f.unlink(missing_ok=True)
            files = [*(f for f in older if f not in dropped), newest]

    def forget_after(self, step: int) -> None:
        """A run resumed at `step` (or started anew: -1) writes its episodes again from there: the files of later
        steps go, and step `step`'s validation lines (its validation runs again)."""
        for path in sorted(episodes_dir(self.run_dir).glob("step-*.jsonl")):
            at = int(path.stem.removeprefix("step-"))
            if at > step:
                path.unlink()
            elif at == step:
                kept = [e for e in read_episodes(path) if e["phase"] == "train"]
                path.write_text("".join(json.dumps(e) + "\n" for e in kept))

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def read_episodes(path: Path) -> list[dict[str, Any]]:
    """One episodes file's lines (a line cut short by a run still writing it is left out)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
