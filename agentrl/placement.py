"""Where the run's device actors go. Each kind of actor (rollout engines, trainer ranks) gets one Ray placement
group, one bundle per actor ({device: n} plus the config's `ray_resources`), strategy PACK: the reservation holds
for the whole run, so an engine the router re-creates at index i lands in bundle i, where the original was, and
never loses its devices to another actor meanwhile. One actor's devices are always on one node (Ray never splits
an actor's resources), so an engine's tensor-parallel devices are co-located by construction.

On CPU without custom resources there is nothing to reserve (and Ray rejects empty bundles): no placement group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentrl.platform import Platform

# The longest `create_placement` waits for Ray to reserve the bundles before it says so in one line.
PLACEMENT_TIMEOUT_S = 300.0


def bundle(platform: Platform, devices: float, extra: Mapping[str, float]) -> dict[str, float]:
    """One actor's resources as a placement-group bundle: its devices (none on CPU) plus custom resources."""
    out = {k: float(v) for k, v in extra.items() if v > 0}
    if platform.is_accelerator and devices > 0 and platform.ray_resource:
        out[platform.ray_resource] = out.get(platform.ray_resource, 0.0) + float(devices)
    return out


def actor_options(
    platform: Platform, devices: float, extra: Mapping[str, float], group: Any = None, index: int = -1
) -> dict[str, Any]:
    """Ray actor options for one actor taking `devices` of the platform's devices and `extra` custom resources,
    inside placement group `group` at bundle `index` when there is one (the request must equal the bundle)."""
    opts: dict[str, Any] = platform.ray_actor_options(devices) if platform.is_accelerator and devices > 0 else {}
    opts["num_cpus"] = 0
    resources = {**opts.pop("resources", {}), **{k: float(v) for k, v in extra.items() if v > 0}}
    if resources:
        opts["resources"] = resources
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
    return opts


@dataclass
class Placement:
    """`count` identical actor slots of one kind; `group` is their Ray placement group (None when the bundles are
    empty). `options(i)` places an actor in slot i; a slot past `count` gets the same resources unplaced."""

    platform: Platform
    devices: float
    extra: dict[str, float]
    count: int
    group: Any = None

    @property
    def bundle(self) -> dict[str, float]:
        return bundle(self.platform, self.devices, self.extra)

    def options(self, index: int) -> dict[str, Any]:
        group = self.group if 0 <= index < self.count else None
        return actor_options(self.platform, self.devices, self.extra, group, index)

    def remove(self) -> None:
        """Free the reservation (the actors in it should be gone); safe to call twice or after ray.shutdown."""
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)


def create_placement(
    platform: Platform,
    devices: float,
    extra: Mapping[str, float],
    count: int,
    name: str = "",
    timeout_s: float = PLACEMENT_TIMEOUT_S,
) -> Placement:
    """Reserve `count` bundles of {device: devices} + `extra`, PACK (as few nodes as possible), and wait until Ray
    has placed them: an unplaceable group is one RuntimeError instead of actors pending forever."""
    placement = Placement(platform, float(devices), {k: float(v) for k, v in extra.items()}, count)
    spec = placement.bundle
    if not spec or count <= 0:
        return placement
    from ray.util.placement_group import placement_group

    placement.group = placement_group([dict(spec) for _ in range(count)], strategy="PACK", name=name)
    if not placement.group.wait(timeout_seconds=timeout_s):
        placement.remove()
        raise RuntimeError(
            f"Ray could not reserve {count} x {spec} for {name or 'the actors'} in {timeout_s:g} s: the cluster lacks "
            "these resources or other jobs hold them (see `ray status`)"
        )
    return placement
