"""Where a trainer rank's tensors live and how its bookkeeping crosses ranks.

Rule: a collective runs where its values already live. Model tensors (FSDP2's all-gathers and reduce-scatters, the
grad norm) stay on the rank's device and use NCCL/HCCL; step bookkeeping (micro-batch counts, loss denominators,
metric sums, object gathers) is host data and goes over gloo as CPU tensors, so it never costs a device copy.
`AGENTRL_STRICT_DEVICES=1` (or `STRICT_DEVICES = True`) checks both rules at the collate output, the loss entry and
before every collective.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from agentrl.trainer.batching import LAYOUT_KEYS

STRICT_DEVICES = os.environ.get("AGENTRL_STRICT_DEVICES", "") == "1"


def check_device(tensors: Iterable[Any], device: torch.device, where: str) -> None:
    """With STRICT_DEVICES: every tensor among `tensors` is on `device` (a CPU tensor in a device computation
    fails late and far from its cause, or silently syncs)."""
    if not STRICT_DEVICES:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise RuntimeError(f"{where}: tensor of shape {tuple(t.shape)} on {t.device}, expected {device}")


def compute_tensors(batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The micro-batch tensors the model and the losses read (all but the host-side layout keys)."""
    return [v for k, v in batch.items() if k not in LAYOUT_KEYS]


def host_all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """all_reduce of step bookkeeping: a CPU tensor over the group's gloo backend (the module's collective rule).
    `group`: the backend's data-parallel group for sums over the batch (tensor-parallel peers hold copies)."""
    if STRICT_DEVICES:
        devices = {pair.split(":")[0] for pair in dist.get_backend_config(group).split(",")}
        if t.device.type != "cpu" or "cpu" not in devices:
            raise RuntimeError(f"bookkeeping collective on {t.device} in a group for {sorted(devices)}")
    dist.all_reduce(t, op=op, group=group)
    return t


def gather_dicts(local: dict[int, Any], group=None) -> dict[int, Any]:
    """Every rank's `local` dict merged (an object all-gather over the group)."""
    parts: list[dict[int, Any]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(parts, local, group=group)
    return {k: v for p in parts for k, v in p.items()}


class RankSums:
    """Named sums over micro-batches, added over ranks in one collective at the end of a step.

    Values may be 0-dim device tensors: they stay on the device (no host sync per micro-batch) and reach the host
    in one copy, where they are added in float64. Every rank declares the same names, so the reduced vectors line
    up; the order lives only in here.
    """

    def __init__(self, names: Iterable[str], group=None) -> None:
        self._names = tuple(names)
        self._group = group  # the data-parallel group: each replica's sums once
        self._rows: list[torch.Tensor] = []  # one float32 vector per micro-batch, on the values' device

    def add(self, values: Mapping[str, float | torch.Tensor]) -> None:
        """Add one micro-batch's values; a name not declared is an error (ranks would disagree on the shape)."""
        for name in values:
            if name not in self._names:
                raise KeyError(f"undeclared sum {name!r} (declared: {', '.join(self._names)})")
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        row = [values.get(n, 0.0) for n in self._names]
        self._rows.append(
            torch.stack([
                v.detach().float().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=device)
                for v in row
            ])
        )  # fmt: skip

    def all_reduce(self) -> dict[str, float]:
        """Collective: the sums over micro-batches and ranks (names never added stay 0)."""
        total = torch.zeros(len(self._names), dtype=torch.float64)
        if self._rows:
            total += torch.stack(self._rows).to("cpu", torch.float64).sum(0)
        host_all_reduce(total, group=self._group)
        return dict(zip(self._names, total.tolist(), strict=True))
