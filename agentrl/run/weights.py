"""The driver's side of a weight sync: how a new policy version gets from the trainer to every rollout engine.

collective (the default for vLLM): trainer rank 0 and the engines' workers share a process group (gloo on CPU,
NCCL on CUDA, HCCL on Ascend) and rank 0 broadcasts the weights in flat buckets, cast to the engines' dtype; no
file is written, so engines on any node get them. The group is rebuilt only when the set of engines changes (a
death or a restart), and an engine restarted in between joins at the next sync.

disk: rank 0 writes a safetensors snapshot (in the engines' dtype) to `rollout.weights_dir` and every engine
reloads it, so the folder must be one every node sees; a sentinel written by rank 0 and read by every engine
checks that at start-up.

With trainer.lora (sync: adapter) the engines serve the adapters on a base they got once: a sync sends the
adapters only (a peft adapter dir on disk, or adapter tensors in the broadcast). The base goes with the first sync
of this driver (it is the warm start's, or a resumed checkpoint's) and, over a collective group, whenever the
group is new (a restarted engine starts from the model path). A disk adapter dir names its base dir, so an engine
restarted from disk loads both.

Either way the router closes each engine's gate and drains it (preempting in-flight generations under partial
rollout) before the load, so no token is sampled on a mix of two versions.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from agentrl.config import Config, ConfigError
from agentrl.platform import Platform
from agentrl.trainer import TrainerGroup
from agentrl.trainer.lora import adapter_config as lora_adapter_config
from agentrl.weightsync.buckets import DEFAULT_BUCKET_BYTES, SyncGroup


class WeightSync:
    def __init__(self, cfg: Config, trainer: TrainerGroup, router: Any, platform: Platform) -> None:
        """`platform`: the one the engines and trainer ranks run on (its collective backend: gloo, nccl, hccl)."""
        self.cfg = cfg
        self.trainer = trainer
        self.router = router
        self.platform = platform
        self.backend = platform.dist_backend
        self.mode = cfg.rollout.resolved_weight_sync
        self.drain = "abort" if cfg.async_.partial_rollout else "wait"
        self.timeout_s = cfg.rollout.weight_sync_timeout_s
        self.delta = cfg.rollout.weight_sync_delta
        lora = cfg.trainer.lora
        self.adapters = lora is not None and lora.sync == "adapter"  # engines serve the adapters (vLLM's LoRA)
        self._base: str | None = None  # disk + adapters: the base dir the engines were sent
        self.root = weights_dir(cfg.rollout.weights_dir, cfg.name)
        self._group: SyncGroup | None = None
        self._members: list | None = None  # who the group was built for
        self._metas: dict[str, list] = {}  # per part sent
        # what an engine that names no dtype gets (the free-space check sizes the same): bf16 on accelerators
        self._default_dtype = str(platform.default_dtype()).removeprefix("torch.")

    # ---- start-up ----------------------------------------------------------------------------------------------
    def check(self, engines: list[Any]) -> None:
        """With disk sync, fail in one line before any engine loads a model if some engine cannot see the folder
        trainer rank 0 writes to, or the folder has no room (engines need not be started)."""
        if self.mode != "disk":
            return
        sentinel = str(self.root / f".sentinel-{uuid.uuid4().hex[:8]}")
        try:
            self.trainer.write_sentinel(sentinel, self._default_dtype)
        except Exception as err:
            raise ConfigError(f"rollout.weights_dir: {_short(err)}") from None
        try:
            seen = ray.get([engine.can_read.remote(sentinel) for engine in engines])
        finally:
            self.trainer.remove_path(str(self.root))  # the first export makes it again; a refused run leaves none
        blind = [str(i) for i, ok in enumerate(seen) if not ok]
        if blind:
            raise ConfigError(
                f"rollout.weights_dir {self.root.parent} is not visible to rollout engine(s) {', '.join(blind)} "
                "(trainer rank 0 wrote a file there that they cannot read: they run on another node): with "
                "rollout.weight_sync: disk, set rollout.weights_dir to a folder on a filesystem every node "
                "shares, or use rollout.weight_sync: collective"
            )

    # ---- one sync ------------------------------------------------------------------------------------------------
    async def sync(self, version: int) -> int | None:
        """The trainer's current weights to every engine, as `version`; returns the bytes trainer rank 0 broadcast
        (None for disk sync). A collective sync that fails (an engine died during it) is retried once with the
        engines still alive; the dead one is restarted by the router."""
        if self.mode == "disk":
            await self._sync_disk(version)
            return None
        try:
            return await self._sync_collective(version)
        except Exception as err:
            print(f"agentrl: weight sync v{version} failed ({_short(err)}); retrying without failed engines",
                  file=sys.stderr, flush=True)  # fmt: skip
            self._members = None
            return await self._sync_collective(version)

    async def _sync_disk(self, version: int) -> None:
        plan = await self.router.weight_sync_members.remote()
        path, dtype = str(self.root / f"v{version}"), plan["dtype"] or self._default_dtype
        if not self.adapters:
            await asyncio.to_thread(self.trainer.export_weights, path, dtype, True)
        else:
            if self._base is None:  # the base the adapters train on, once: engines load it when their base differs
                self._base = str(self.root / f"base-v{version}")
                await asyncio.to_thread(self.trainer.export_weights, self._base, dtype, False, "base")
            await asyncio.to_thread(self.trainer.export_weights, path, dtype, True, "adapters", self._base)
        await self.router.update_weights.remote(path, version, self.drain)

    async def _sync_collective(self, version: int) -> int:
        plan = await self.router.weight_sync_members.remote()
        dtype = plan["dtype"] or self._default_dtype
        members = await self.router.hold.remote(plan["members"], self.drain)  # all drained: the group forms at once
        new_group = members != self._members
        part = "model" if not self.adapters else "base+adapters" if new_group else "adapters"
        if part not in self._metas:
            self._metas[part] = await asyncio.to_thread(self.trainer.weight_metas, dtype, part)
        if new_group:  # a new set of engines: a new group (the old one is dropped on both ends)
            addr, port = await asyncio.to_thread(self.trainer.sync_address)
            world = 1 + sum(workers for _, _, workers in members)
            self._group = SyncGroup(addr, port, world, self.backend, self.timeout_s)
            self._members = members
        where = asdict(self._group)
        source = {"group": where, "metas": self._metas[part], "bucket_bytes": DEFAULT_BUCKET_BYTES,
                  "delta": self.delta}  # fmt: skip
        if self.adapters:
            source["adapters"] = lora_adapter_config(self.cfg.trainer.lora)
        updated = self.router.update_weights.remote(source, version, self.drain, members)
        if not members:  # no engine to send to: the router still records the version for engines that rejoin
            await updated
            return 0
        sent = self.trainer.broadcast_weights_async(where, dtype, DEFAULT_BUCKET_BYTES, self.delta, part)
        # both sides at once; the first failure ends the wait (the other side then times out in its group)
        _, sent_bytes = await asyncio.wait_for(asyncio.gather(_await(updated), _await(sent)), self.timeout_s + 30)
        return int(sent_bytes)

    def close(self) -> None:
        """The writer removes its snapshots (on its own node)."""
        if self.mode == "disk":
            self.trainer.remove_path(str(self.root))


async def _await(ref: Any) -> Any:
    return await ref


def _short(err: BaseException) -> str:
    lines = str(getattr(err, "cause", None) or err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:200]


def weights_dir(base: str | None, name: str) -> Path:
    """Where disk weight snapshots go: `base` (rollout.weights_dir, a folder every node sees) or shared memory on
    a single node; one folder per driver process (two runs with one name do not collide), and folders that dead
    drivers on this host left (kill -9) removed."""
    root = Path(base).absolute() if base else (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp"))
    host = socket.gethostname()
    for old in root.glob(f"agentrl-weights-*-{host}-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return root / f"agentrl-weights-{name}-{host}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
