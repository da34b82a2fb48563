"""RUN_DIR/episodes on its own: which episodes are picked, how per-token advantages map onto turns, how the folder
is kept under its cap. The files a real run writes are checked in test_viewer.py."""

from __future__ import annotations

import json

from agentrl.run.episode_log import EpisodeLog, episodes_file, pick, read_episodes, turn_advantages
from agentrl.types import EpisodeRecord, Sample


def _record(tag: str, ret: float, turns: list[list[int]] | None = None, eid: str | None = None) -> EpisodeRecord:
    turns = turns or [[1, 2]]
    return EpisodeRecord(
        episode_id=eid or f"train/{tag}/{ret}", env_id="e", tag=tag, split="train", seed=0, episode_return=ret,
        env_return=ret, turns=[{"token_ids": t, "versions": [0] * len(t), "reward": 0.0} for t in turns],
    )  # fmt: skip


def test_pick_takes_the_worst_the_best_then_random_ones_per_tag():
    records = [_record("a", r) for r in (0.5, -1.0, 2.0, 0.1, 0.3)] + [_record("b", 1.0)]
    picked = pick(records, per_tag=3, seed=7)
    a = [(why, r.episode_return) for why, r in picked if r.tag == "a"]
    assert a[:2] == [("worst", -1.0), ("best", 2.0)]
    assert a[2][0] == "random" and a[2][1] in (0.5, 0.1, 0.3)
    assert [(why, r.tag) for why, r in picked if r.tag == "b"] == [("worst", "b")]  # one episode: picked once
    assert pick(records, per_tag=3, seed=7) == picked  # seeded by the step: a resumed run picks the same
    assert len(pick(records, per_tag=1, seed=0)) == 2  # one per tag


def test_trajectory_advantages_follow_the_model_token_runs():
    rec = _record("a", 1.0, turns=[[5, 6], [7], [8, 9, 10]])
    # prompt 1 2, turn 5 6, observation 3, turn 7, observation 4 4, turn 8 9 10
    sample = Sample(
        token_ids=[1, 2, 5, 6, 3, 7, 4, 4, 8, 9, 10], loss_mask=[0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1],
        logprobs=[0.0] * 11, versions=[0] * 11, reward=1.0, group_id="g", episode_id=rec.episode_id,
    )  # fmt: skip
    adv = [0, 0, 0.5, 0.5, 0, 0.25, 0, 0, 1.0, 1.0, 1.0]
    assert turn_advantages(rec, [(sample, adv)]) == [[0.5, 0.5], [0.25], [1.0, 1.0, 1.0]]
    wrong = _record("a", 1.0, turns=[[5, 6], [8]])  # not the sample's tokens: no advantages rather than wrong ones
    assert turn_advantages(wrong, [(sample, adv)]) is None


def test_step_wise_advantages_come_from_each_turn_sample():
    rec = _record("a", 1.0, turns=[[5, 6], [7]])

    def turn_sample(k: int, prompt: list[int], ids: list[int]) -> Sample:
        n = len(prompt) + len(ids)
        mask = [0] * len(prompt) + [1] * len(ids)
        return Sample(prompt + ids, mask, [0.0] * n, [0] * n, 1.0, "g", rec.episode_id, turn_index=k)

    pairs = [(turn_sample(1, [1, 3], [7]), [0, 0, -0.5]), (turn_sample(0, [1, 2], [5, 6]), [0, 0, 0.3, 0.3])]
    assert turn_advantages(rec, pairs) == [[0.3, 0.3], [-0.5]]


def test_the_log_writes_lines_and_thins_older_files_past_its_cap(tmp_path):
    seen = []
    log = EpisodeLog(tmp_path, every_steps=2, per_tag=2, max_mb=0.02, decode=lambda t: f"<{t}>",
                     on_write=lambda step, phase, lines: seen.append((step, phase, len(lines))))  # fmt: skip
    assert [s for s in range(1, 7) if log.due(s)] == [2, 4, 6]
    records = [_record("a", r, turns=[[1, 2, 3] * 40]) for r in (0.0, 1.0)]  # ~1.4 KB a line
    for step in range(1, 9):
        log.write(step, "train", pick(records, 2, step), {records[0].episode_id: [[0.5] * 120]})
    log.close()
    lines = read_episodes(episodes_file(tmp_path, 8))
    assert [(e["picked"], e["step"], e["phase"]) for e in lines] == [("worst", 8, "train"), ("best", 8, "train")]
    assert lines[0]["turns"][0]["tokens"][:2] == ["<1>", "<2>"] and lines[0]["turns"][0]["advantage"] == 0.5
    assert "advantages" not in lines[1]["turns"][0]  # the trainer reported none for it
    kept = sorted(p.name for p in (tmp_path / "episodes").iterdir())
    size = sum(p.stat().st_size for p in (tmp_path / "episodes").iterdir())
    assert size <= 0.02 * 2**20 and 2 < len(kept) < 8, kept  # thinned to the cap, a sample of the history left
    assert kept[0] == "step-000001.jsonl" and kept[-1] == "step-000008.jsonl"  # the first and the newest stay
    assert seen == [(s, "train", 2) for s in range(1, 9)]  # every write reached the trackers' hook
    json.dumps(lines)  # plain data


def test_a_resumed_run_forgets_the_episodes_after_its_checkpoint(tmp_path):
    log = EpisodeLog(tmp_path, every_steps=1, per_tag=1, max_mb=100)
    records = [_record("a", 1.0)]
    for step in (1, 2, 3):
        log.write(step, "train", pick(records, 1, step))
        log.write(step, "validation", pick(records, 1, step))
    log.close()
    log.forget_after(2)  # resumed at step 2: its validation runs again, steps after it are trained again
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == ["step-000001.jsonl", "step-000002.jsonl"]
    assert [e["phase"] for e in read_episodes(episodes_file(tmp_path, 2))] == ["train"]
    assert [e["phase"] for e in read_episodes(episodes_file(tmp_path, 1))] == ["train", "validation"]
    log.forget_after(-1)  # started anew
    assert not list((tmp_path / "episodes").iterdir())
