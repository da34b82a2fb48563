"""After a training step and a weight sync, the vLLM-CPU engines' log-probs of a fixed sequence match the
trainer's log-probs at the new version (real FSDP2 rank, real engines, the tiny model), for both ways weights
travel: a safetensors snapshot the engine reloads (disk), and the bucketed broadcast over a gloo group from
trainer rank 0 to the engine workers (collective), through the router's gate and drain."""

from __future__ import annotations

import math

import pytest

from agentrl.config import load_config
from agentrl.config.schema import SamplingConfig
from agentrl.platform import CPU
from agentrl.run.weights import WeightSync
from agentrl.trainer import TrainerGroup
from agentrl.types import Sample
from tests.conftest import TEST_KV_CACHE_GIB

PROMPT = [5, 6, 7, 8, 9, 10]


def _batch(ids: list[int], logprobs: list[float]) -> list[Sample]:
    n = len(ids) - len(PROMPT)
    return [
        Sample(ids, [0] * len(PROMPT) + [1] * n, [0.0] * len(PROMPT) + logprobs, [-1] * len(PROMPT) + [0] * n,
               reward=r, group_id="g", episode_id=f"e{r}")
        for r in (1.0, -1.0)
    ]  # fmt: skip


async def _check_engine_matches_trainer(engine, trainer: TrainerGroup, version: int, tag: str) -> None:
    greedy = await engine.generate.remote(PROMPT, SamplingConfig(max_tokens=16, temperature=0.0), f"greedy-{tag}")
    assert greedy.version == version
    seq = PROMPT + greedy.token_ids
    probe = Sample(seq, [0] * len(PROMPT) + [1] * len(greedy.token_ids), [0.0] * len(seq), [-1] * len(seq),
                   reward=0.0, group_id="p", episode_id="p")  # fmt: skip
    (trained,) = trainer.compute_logprobs([probe])
    for engine_lp, trainer_lp in zip(greedy.logprobs, trained[len(PROMPT) :], strict=True):
        assert abs(engine_lp - trainer_lp) < 2e-3, (tag, engine_lp, trainer_lp)


@pytest.mark.parametrize("mode", ["disk", "collective"])
async def test_engine_logprobs_match_trainer_after_sync(vllm_fleet, tiny_model_path, mode):
    _, engines, router = vllm_fleet
    out = await engines[0].generate.remote(PROMPT, SamplingConfig(max_tokens=16, temperature=1.0, seed=1), "s-0")
    batch = _batch(PROMPT + out.token_ids, out.logprobs)
    cfg = load_config(None, ["trainer.optim.lr=0.01", "trainer.algorithm.loss=ppo_clip", "rollout.num_engines=2",
                             f"rollout.weight_sync={mode}", f"name=sync-{mode}"])  # fmt: skip
    trainer = TrainerGroup(cfg, tiny_model_path)
    sync = WeightSync(cfg, trainer, router, CPU)
    try:
        sync.check(engines)
        for version in (100, 101):  # the second collective sync reuses the group built by the first
            trainer.train_step(batch)
            await sync.sync(version)
            for i, engine in enumerate(engines):
                await _check_engine_matches_trainer(engine, trainer, version, f"{mode}-{version}-{i}")
        (moved,) = trainer.compute_logprobs([batch[0]])
        assert max(abs(a - b) for a, b in zip(out.logprobs, moved[len(PROMPT) :], strict=True)) > 1e-3
    finally:
        sync.close()
        trainer.shutdown()


def _move_prompt_rows(rank) -> int:
    """In trainer rank 0: what a bf16-sized training step is to the weights, a few rows moved (the embedding rows
    of the prompt's tokens; the tied head moves with them). Returns the elements moved."""
    import torch

    emb = dict(rank.model.named_parameters())["model.embed_tokens.weight"]
    local = emb.to_local() if hasattr(emb, "to_local") else emb  # FSDP2 at world size 1: the whole tensor
    rows = torch.tensor(PROMPT)
    with torch.no_grad():
        local[rows] += 0.05 * torch.randn(len(PROMPT), local.shape[1], generator=torch.Generator().manual_seed(0))
    return len(PROMPT) * local.shape[1]


async def _greedy_logprobs(engines, tag: str) -> list[list[float]]:
    sampling = SamplingConfig(max_tokens=16, temperature=0.0)
    return [(await e.generate.remote(PROMPT, sampling, f"{tag}-{i}")).logprobs for i, e in enumerate(engines)]


async def test_delta_sync_moves_only_the_changed_elements_and_loads_what_a_full_sync_does(vllm_fleet, tiny_model_path):
    """rollout.weight_sync_delta through the real engines: the first sync of a group is full; after a change to a
    few rows only those travel, and the engines then compute the trainer's log-probs; a full sync of the same
    weights (a new group) leaves every engine's greedy log-probs bit for bit as the delta left them; a real
    optimizer step in float32 moves nearly every element, so the buckets then travel whole."""
    _, engines, router = vllm_fleet
    cfg = load_config(None, ["trainer.optim.lr=0.01", "trainer.algorithm.loss=ppo_clip", "rollout.num_engines=2",
                             "rollout.weight_sync=collective", "rollout.weight_sync_delta=true",
                             "name=sync-delta"])  # fmt: skip
    trainer = TrainerGroup(cfg, tiny_model_path)
    sync = WeightSync(cfg, trainer, router, CPU)
    try:
        full = await sync.sync(200)
        assert full > 4 * (await trainer.ranks[0].__ray_call__.remote(_move_prompt_rows)) * 4  # whole model sent
        sent = await sync.sync(201)
        assert sent < full / 20, (sent, full)  # a few rows: their indices and values
        for i, engine in enumerate(engines):
            await _check_engine_matches_trainer(engine, trainer, 201, f"delta-{i}")
        after_delta = await _greedy_logprobs(engines, "after-delta")
        sync._members = None  # as after an engine restart: a new group, whose first sync is full
        assert await sync.sync(202) >= full
        assert await _greedy_logprobs(engines, "after-full") == after_delta
        outs = [await engines[0].generate.remote(PROMPT, SamplingConfig(max_tokens=16, temperature=1.0, seed=seed),
                                                 f"d-{seed}") for seed in (1, 2)]  # fmt: skip
        good, bad = (_batch(PROMPT + o.token_ids, o.logprobs) for o in outs)
        trainer.train_step([good[0], bad[1]])  # two different completions, rewards 1 and -1
        sent = await sync.sync(203)
        assert sent >= full, (sent, full)  # float32 Adam step: nearly every element moved
        for i, engine in enumerate(engines):
            await _check_engine_matches_trainer(engine, trainer, 203, f"delta-step-{i}")
    finally:
        sync.close()
        trainer.shutdown()


async def test_a_lora_policy_reaches_the_engines_merged(vllm_fleet, tiny_model_path):
    """trainer.lora: the engines serve the base model with the trained adapters merged in (collective sync, under
    the HF names), and their log-probs then match the trainer's."""
    _, engines, router = vllm_fleet
    cfg = load_config(None, ["trainer.optim.lr=0.01", "trainer.algorithm.loss=ppo_clip", "rollout.num_engines=2",
                             "rollout.weight_sync=collective", "trainer.lora.rank=8", "trainer.lora.sync=merged",
                             "name=sync-lora"])  # fmt: skip
    trainer = TrainerGroup(cfg, tiny_model_path)
    sync = WeightSync(cfg, trainer, router, CPU)
    try:
        outs = [await engines[0].generate.remote(PROMPT, SamplingConfig(max_tokens=16, temperature=1.0, seed=seed),
                                                 f"l-{seed}") for seed in (1, 2)]  # fmt: skip
        good, bad = (_batch(PROMPT + o.token_ids, o.logprobs) for o in outs)
        for version in (300, 301):
            trainer.train_step([good[0], bad[1]])
            await sync.sync(version)
            for i, engine in enumerate(engines):
                await _check_engine_matches_trainer(engine, trainer, version, f"lora-{version}-{i}")
        (moved,) = trainer.compute_logprobs([good[0]])
        assert max(abs(a - b) for a, b in zip(outs[0].logprobs, moved[len(PROMPT) :], strict=True)) > 1e-3
    finally:
        sync.close()
        trainer.shutdown()


def _fp32_bytes(trainer: TrainerGroup, part: str) -> int:
    return sum(4 * math.prod(shape) for _, shape, _ in trainer.weight_metas("float32", part))


async def test_engines_serve_the_adapters_and_a_sync_moves_only_them(ray_session, tiny_model_path, tmp_path):
    """trainer.lora with sync: adapter, on a real LoRA-serving vLLM engine. After a full warm start the first sync
    brings the new base and the adapters; later syncs move the adapters alone (collective: the bytes broadcast;
    disk: the files written), and the engine's log-probs match the trainer's at every version. A disk sync names
    its base, which an engine holding another base loads first."""
    import os

    from agentrl.rollout.fleet import EngineSpec, start_engines, start_router

    cfg = load_config(None, ["trainer.optim.lr=0.01", "trainer.algorithm.loss=ppo_clip", "trainer.lora.rank=8",
                             "rollout.weight_sync=collective", "name=sync-adapters", "trainer.sft.lr=0.01",
                             f"rollout.kv_cache_gib={TEST_KV_CACHE_GIB}"])  # fmt: skip
    engines = start_engines(EngineSpec(cfg.rollout, tiny_model_path, lora=cfg.trainer.lora))
    router = start_router(engines, cfg.rollout)
    trainer = TrainerGroup(cfg, tiny_model_path)
    sync = WeightSync(cfg, trainer, router, CPU)
    disk_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"weight_sync": "disk"})})
    disk = WeightSync(disk_cfg, trainer, router, CPU)
    try:
        out = await engines[0].generate.remote(PROMPT, SamplingConfig(max_tokens=16, temperature=1.0, seed=1), "a")
        batch = _batch(PROMPT + out.token_ids, out.logprobs)
        trainer.sft_step(batch[:1])  # a full warm start: the base moves, then fresh adapters sit on it
        trainer.end_warm_start(str(tmp_path / "warm"))
        adapters = _fp32_bytes(trainer, "adapters")
        assert await sync.sync(1) == _fp32_bytes(trainer, "base") + adapters  # the new base goes with the first
        await _check_engine_matches_trainer(engines[0], trainer, 1, "adapters-1")
        for version in (2, 3):
            trainer.train_step(batch)
            assert await sync.sync(version) == adapters  # the adapters alone
            await _check_engine_matches_trainer(engines[0], trainer, version, f"adapters-{version}")
        (moved,) = trainer.compute_logprobs([batch[0]])
        assert max(abs(a - b) for a, b in zip(out.logprobs, moved[len(PROMPT) :], strict=True)) > 1e-3

        disk.check(engines)
        for version in (4, 5):  # the first disk sync writes the base once, then each one an adapter dir
            trainer.train_step(batch)
            await disk.sync(version)
            written = {p.name: p for p in disk.root.iterdir()}
            assert set(written) == {"base-v4", f"v{version}"}
            files = sorted(os.listdir(written[f"v{version}"]))
            assert files == ["adapter_config.json", "adapter_model.safetensors"]
            assert (written[f"v{version}"] / "adapter_model.safetensors").stat().st_size < 1.1 * adapters
            await _check_engine_matches_trainer(engines[0], trainer, version, f"adapters-disk-{version}")
    finally:
        sync.close()
        disk.close()
        trainer.shutdown()
        for handle in [*engines, router]:
            ray_session.kill(handle)
