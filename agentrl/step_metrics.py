"""Per-step metrics with the names DESIGN.md fixes (tests and benchmarks read them)."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean
from typing import Any

from agentrl.buffer import staleness
from agentrl.config.schema import Config
from agentrl.envmanager.manager import GroupResult
from agentrl.types import Sample


def batch_metrics(groups: list[GroupResult], samples: list[Sample], trainer_version: int) -> dict[str, float]:
    episodes = [e for g in groups for e in g.episodes]
    out: dict[str, float] = {}
    if episodes:
        for key in ("return", "success", "turns", "length"):
            out[f"episode/{key}"] = mean(e.get(key, 0.0) for e in episodes)
        for key in ("llm", "env", "tool"):
            out[f"time/{key}"] = mean(e.get(f"time/{key}", 0.0) for e in episodes)
    by_tag: dict[str, list[dict[str, float]]] = defaultdict(list)
    for g in groups:
        by_tag[g.tag] += g.episodes
    for tag, eps in by_tag.items():
        for key in {k for e in eps for k in e if not k.startswith("time/")}:
            out[f"env/{tag}/{key}"] = mean(e.get(key, 0.0) for e in eps)
    stale = staleness(samples, trainer_version)
    if stale:
        out["staleness/mean"] = mean(stale)
        out["staleness/max"] = float(max(stale))
    if samples:
        out["partial/ratio"] = sum(len(s.policy_versions) > 1 for s in samples) / len(samples)
        out["partial/resumed"] = float(sum(e.get("resumes", 0.0) for e in episodes))
    out["rollout/failed_episodes"] = float(sum(len(g.failures) for g in groups))
    out["rollout/missing_rewards"] = float(sum(len(g.missing_rewards) for g in groups))
    return out


def validation_metrics(groups: list[GroupResult]) -> dict[str, float]:
    out: dict[str, float] = {}
    by_tag: dict[str, list[dict[str, float]]] = defaultdict(list)
    for g in groups:
        by_tag[g.tag] += g.episodes
    for tag, eps in by_tag.items():
        if eps:
            out[f"val/{tag}/success"] = mean(e.get("success", 0.0) for e in eps)
            out[f"val/{tag}/return"] = mean(e.get("return", 0.0) for e in eps)
    if by_tag:
        out["val/success"] = mean(v for k, v in out.items() if k.endswith("/success"))
    return out


async def evaluate(cfg: Config, managers: list[Any]) -> dict[str, float]:
    """`validation.episodes_per_tag` held-out episodes per val tag (the train tags when there are none),
    spread over the env managers; success and return per tag."""
    import asyncio

    v = cfg.validation
    envs, split = (cfg.envs.val, "val") if cfg.envs.val else (cfg.envs.train, "train")
    jobs = [
        managers[i % len(managers)].run_group.remote(tag, v.seed_start + spec.seed_start + i, split, 1)
        for tag, spec in envs.items()
        for i in range(v.episodes_per_tag)
    ]
    return validation_metrics(list(await asyncio.gather(*jobs))) if jobs else {}
