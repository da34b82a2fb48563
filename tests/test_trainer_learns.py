"""End-to-end direction check of the RL update through the real FSDP2 rank: in a group where one continuation is
rewarded and another is not, a few decoupled-PPO steps raise the rewarded one's log-prob and lower the other's."""

from __future__ import annotations

import itertools

from agentrl.config import load_config
from agentrl.trainer import TrainerGroup
from agentrl.types import Sample

PROMPT, GOOD, BAD = [5, 6, 7, 8, 9, 10], [20, 21, 22], [30, 31, 32]


def _sample(cont: list[int], reward: float, episode: str, logprobs: list[float]) -> Sample:
    n = len(PROMPT)
    return Sample(PROMPT + cont, [0] * n + [1] * 3, [0.0] * n + logprobs, [-1] * n + [0] * 3, reward=reward,
                  group_id="g", episode_id=episode)  # fmt: skip


def test_rl_steps_move_probability_to_the_rewarded_continuation(ray_session, tiny_model_path):
    trainer = TrainerGroup(load_config(None, ["trainer.algorithm.loss=decoupled_ppo"]), tiny_model_path)
    probe = [_sample(GOOD, 0.0, "pg", [0.0] * 3), _sample(BAD, 0.0, "pb", [0.0] * 3)]
    try:
        history = []
        for _ in range(4):
            lp_good, lp_bad = (lp[len(PROMPT) :] for lp in trainer.compute_logprobs(probe))
            history.append((sum(lp_good), sum(lp_bad)))
            batch = [_sample(GOOD, 1.0, f"g{i}", lp_good) for i in range(4)]
            batch += [_sample(BAD, 0.0, f"b{i}", lp_bad) for i in range(4)]
            metrics = trainer.train_step(batch)
            assert metrics["train/is_weight_mean"] > 0.99  # on-policy: behaviour == proximal
    finally:
        trainer.shutdown()
    goods, bads = zip(*history, strict=True)
    assert all(b > a for a, b in itertools.pairwise(goods)), goods
    assert all(b < a for a, b in itertools.pairwise(bads)), bads
