"""Per-step metrics of the groups a step trained on, and of validation, under the logged metric names (tests
and benchmarks read them; docs/guides/observability.md lists them)."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

from agentrl.run.buffer import staleness
from agentrl.types import Group, Sample

_EPISODE_KEYS = ("return", "success", "turns", "length")
_TIME_KEYS = ("llm", "env", "tool")


def _by_tag(groups: list[Group]) -> dict[str, list[dict[str, float]]]:
    by_tag: dict[str, list[dict[str, float]]] = defaultdict(list)
    for g in groups:
        by_tag[g.tag] += g.episode_metrics
    return by_tag


def batch_metrics(groups: list[Group], samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """`episode/*`, `timing/episode_*` (seconds per episode in the model, the env, tools), `reward/*` (reward
    functions' own metrics), `env/<tag>/*`, `staleness/*` and `partial/*` of one training batch."""
    episodes = [e for g in groups for e in g.episode_metrics]
    out: dict[str, float] = {}
    if episodes:
        for key in _EPISODE_KEYS:
            out[f"episode/{key}"] = mean(e.get(key, 0.0) for e in episodes)
        for key in _TIME_KEYS:
            out[f"timing/episode_{key}"] = mean(e.get(f"timing/episode_{key}", 0.0) for e in episodes)
        for key in sorted({k for e in episodes for k in e if k.startswith("reward/")}):
            out[key] = mean(e[key] for e in episodes if key in e)
    for tag, eps in _by_tag(groups).items():
        for key in {k for e in eps for k in e if not k.startswith(("timing/", "reward/"))}:
            out[f"env/{tag}/{key}"] = mean(e.get(key, 0.0) for e in eps)
    stale = staleness(samples, trainer_version)
    if stale:
        out["staleness/mean"] = mean(stale)
        out["staleness/max"] = float(max(stale))
    if samples:
        out["partial/ratio"] = sum(len(s.policy_versions) > 1 for s in samples) / len(samples)
        out["partial/resumed"] = float(sum(e.get("resumes", 0.0) for e in episodes))
    return out


def validation_metrics(groups: list[Group]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tag, eps in _by_tag(groups).items():
        if eps:
            out[f"val/{tag}/success"] = mean(e.get("success", 0.0) for e in eps)
            out[f"val/{tag}/return"] = mean(e.get("return", 0.0) for e in eps)
    if out:
        out["val/success"] = mean(v for k, v in out.items() if k.endswith("/success"))
    return out
