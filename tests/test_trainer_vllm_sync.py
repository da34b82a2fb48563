"""After a training step and a weight sync, the vLLM-CPU engine's log-probs of a fixed sequence match the
trainer's log-probs at the new version (real FSDP2 rank, real engine, the tiny model)."""

from __future__ import annotations

from agentrl.config import load_config
from agentrl.config.schema import SamplingConfig
from agentrl.trainer import TrainerGroup
from agentrl.types import Sample


async def test_engine_logprobs_match_trainer_after_sync(vllm_fleet, tiny_model_path, tmp_path):
    _, engines, _ = vllm_fleet
    engine = engines[0]
    prompt = [5, 6, 7, 8, 9, 10]
    out = await engine.generate.remote(prompt, SamplingConfig(max_tokens=16, temperature=1.0, seed=1), "sync-0")
    ids = prompt + out.token_ids
    n = len(out.token_ids)
    mask = [0] * len(prompt) + [1] * n
    batch = [
        Sample(ids, mask, [0.0] * len(prompt) + out.logprobs, [-1] * len(prompt) + [0] * n, reward=r,
               group_id="g", episode_id=f"e{r}")
        for r in (1.0, -1.0)
    ]  # fmt: skip
    cfg = load_config(None, ["trainer.optim.lr=0.01", "trainer.algorithm.loss=ppo_clip"])
    trainer = TrainerGroup(cfg, tiny_model_path)
    try:
        trainer.train_step(batch)
        path = trainer.export_weights(str(tmp_path / "w"))
        await engine.update_weights.remote(path, 100)
        greedy = await engine.generate.remote(prompt, SamplingConfig(max_tokens=16, temperature=0.0), "sync-greedy")
        assert greedy.version == 100
        seq = prompt + greedy.token_ids
        probe = Sample(seq, [0] * len(prompt) + [1] * len(greedy.token_ids), [0.0] * len(seq), [-1] * len(seq),
                       reward=0.0, group_id="p", episode_id="p")  # fmt: skip
        trained_greedy, trained_sampled = trainer.compute_logprobs([probe, batch[0]])
    finally:
        trainer.shutdown()
    moved = max(abs(a - b) for a, b in zip(out.logprobs, trained_sampled[len(prompt) :], strict=True))
    assert moved > 1e-3, "the training step should have moved the log-probs"
    for engine_lp, trainer_lp in zip(greedy.logprobs, trained_greedy[len(prompt) :], strict=True):
        assert abs(engine_lp - trainer_lp) < 2e-3, (engine_lp, trainer_lp)
