"""How a trainer rank hands its weights to the rollout engines and the run: HF safetensors snapshots on disk
(rollout.weight_sync=disk, cached warm starts), bucketed broadcasts over a weight-sync group
(rollout.weight_sync=collective), and the checks that the folders involved are shared and big enough.

A mixin of `TrainerRank` (the Ray actor), kept apart from the training steps; it uses the rank's `backend`,
`cfg`, `model`, `tied`, `rank`, `model_path`, `_sync_groups` and `_pack_buffer`.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist

from agentrl.config.schema import Config
from agentrl.trainer import lora
from agentrl.trainer.backends import ModelBackend
from agentrl.trainer.checkpoint import copy_hf_side_files, write_safetensors
from agentrl.weightsync import send
from agentrl.weightsync.adapters import write_adapter
from agentrl.weightsync.buckets import GroupCache, PackBuffer, SyncError, SyncGroup, free_port

Part = Literal["model", "base", "adapters", "base+adapters"]


class WeightPublisher:
    cfg: Config
    backend: ModelBackend
    model: torch.nn.Module
    tied: bool
    rank: int
    model_path: str
    _sync_groups: GroupCache
    _pack_buffer: PackBuffer

    def export_weights(
        self, out_dir: str, dtype: str = "float32", prune_older: bool = False, part: Part = "model", base: str = ""
    ) -> str:
        """Weights as safetensors in `dtype`, by rank 0: what engines reload (rollout.weight_sync=disk;
        `prune_older` then removes the earlier `v*` snapshots beside it), or a cached warm start. `part`: the
        whole (merged) model as an HF model dir; with trainer.lora also "base" (the frozen base, an HF model dir)
        or "adapters" (a peft adapter dir whose adapter_config.json names `base`, the base dir it goes with).
        Collective: every rank walks the backend's gathers."""
        cast, state = getattr(torch, dtype), {}
        for name, t in self._weights(part):
            if self.rank == 0:
                state[name] = (t.to(cast) if t.is_floating_point() else t).detach().to("cpu").contiguous()
        if self.rank == 0:
            if part == "adapters":
                write_adapter(out_dir, state, lora.adapter_config(self.cfg.trainer.lora, base or None))
            else:
                write_safetensors(state, out_dir)
                if not os.path.exists(os.path.join(out_dir, "config.json")):
                    copy_hf_side_files(self.model_path, out_dir)
            if prune_older:
                _remove_older_snapshots(out_dir)
        dist.barrier()
        return out_dir

    def _weights(self, part: Part) -> Iterator[tuple[str, torch.Tensor]]:
        if part == "model":
            return self.backend.full_weights(self.model, self.tied)
        return self.backend.lora_weights(self.model, self.tied, "base" in part, "adapters" in part)

    def _metas(self, part: Part) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if part == "model":
            return self.backend.weight_metas(self.model, self.tied)
        return self.backend.lora_metas(self.model, self.tied, "base" in part, "adapters" in part)

    def write_sentinel(self, path: str, dtype: str) -> None:
        """Rank 0 writes a file the engines must then read (is the weights dir shared with them?) and checks the
        folder has room for two snapshots (a container's 64 MB /dev/shm passes an is_dir check, then fails)."""
        if self.rank != 0:
            return
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        weights = sum(math.prod(shape) for _, shape, _ in self.backend.weight_metas(self.model, self.tied))
        need = 2 * weights * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        free = shutil.disk_usage(folder).free
        if free < need:
            raise RuntimeError(
                f"{folder} has {free / 2**20:.0f} MiB free and two weight snapshots need {need / 2**20:.0f} MiB: "
                "set rollout.weights_dir to a bigger folder every node sees, or use rollout.weight_sync: collective"
            )
        with open(path, "w") as f:
            f.write("agentrl weights_dir check\n")

    @staticmethod
    def can_read(path: str) -> bool:
        """Whether this rank's node sees `path` (the shared run dir check)."""
        return os.path.exists(path)

    def remove_path(self, path: str) -> None:
        """Rank 0 removes a file or folder it wrote on its node (snapshots, the sentinel)."""
        if self.rank == 0:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)

    def weight_metas(self, dtype: str, part: Part = "model") -> list[tuple[str, list[int], str]]:
        """Names, full shapes and dtypes of what `broadcast_weights` sends, as plain values (engines receive them
        through vLLM's RPC): the receivers allocate from them."""
        metas = send.weight_metas(self._metas(part), getattr(torch, dtype))
        return [(m.name, list(m.shape), m.dtype) for m in metas]

    def broadcast_weights(
        self, where: dict, dtype: str, bucket_bytes: int, delta: bool = False, part: Part = "model"
    ) -> int:
        """Collective: every rank gathers each weight in turn; rank 0 joins the weight-sync group `where`
        (`SyncGroup` fields) as its rank 0 and broadcasts the buckets while the engine workers receive them.
        Returns the bytes sent (rank 0). `delta`: send each bucket's changes since the last sync in this group
        when smaller (`agentrl.weightsync.delta`). `part`: as `export_weights`; "base+adapters" sends both.

        An engine that dies or hangs in the group fails the sync within the group's timeout (`SyncError` from
        rank 0), never the trainer: rank 0 still walks every gather with the other ranks, drops (aborts) the
        group, and the next sync builds a new one."""
        sync = SyncGroup(**where)
        group, join_error = None, None
        if self.rank == 0:
            try:
                group = self._sync_groups.get(sync, rank=0)
            except Exception as err:  # an engine that never joined: the store or the group timed out
                join_error = err
        metas = send.weight_metas(self._metas(part), getattr(torch, dtype))
        full = self._weights(part)
        try:
            bases = self._sync_groups.bases if delta else None
            sent = send.broadcast_weights(group, full, metas, bucket_bytes, self._pack_buffer, sync.timeout_s, bases)
        except SyncError:
            self._sync_groups.fail()
            self._pack_buffer = PackBuffer()  # an aborted send may still hold the old one
            raise
        if join_error is not None:
            self._sync_groups.fail()
            raise SyncError(
                f"the engines did not join the weight-sync group at {sync.addr}:{sync.port} within "
                f"{sync.timeout_s:.0f} s: {type(join_error).__name__}: {str(join_error).strip()[:300]}"
            )
        return sent

    def sync_address(self) -> tuple[str, int]:
        """Rank 0: where the next weight-sync group meets, this node's IP and a port from
        `rollout.weight_sync_ports` (any free port when unset); the group it hosts now is dropped first, so a
        range of one port is enough."""
        import ray

        self._sync_groups.close()
        return ray.util.get_node_ip_address(), free_port(self.cfg.rollout.weight_sync_port_range)

    def save_warm_start(self, path: str) -> bool:
        """Collective: the full weights (float32) as an HF model dir at `path`, written by rank 0 into a temporary
        folder beside it and renamed there, on rank 0's own node (the driver may be on another node, which would
        not see the folder): a reader never sees half a model. False when another run saved it first."""
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        self.export_weights(tmp, "float32")
        if self.rank != 0:
            return False
        try:
            os.rename(tmp, path)
        except OSError:  # another run with the same key saved it first
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True


def _remove_older_snapshots(current: str) -> None:
    """The writer cleans up: once `current` is written, earlier snapshots beside it are no longer read."""
    parent, name = os.path.split(os.path.normpath(current))
    for other in os.listdir(parent):
        if other != name and other.startswith("v"):
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)
