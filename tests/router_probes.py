"""What tests read inside a router actor that the run itself never asks for (the router's API stays the run's)."""

from __future__ import annotations

from typing import Any


async def sticky_engine(router: Any, episode_id: str) -> int | None:
    """The engine an episode is pinned to, None when it is not (released, or never placed)."""
    return await router.__ray_call__.remote(lambda r, episode: r._sticky.get(episode), episode_id)


async def engines_alive(router: Any) -> list[bool]:
    """Per engine slot: whether the router counts it alive."""
    return await router.__ray_call__.remote(lambda r: [slot.alive for slot in r.health.slots])
