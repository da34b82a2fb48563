"""The flat-bucket format of the collective weight broadcast, shared by its two ends.

The sender (trainer rank 0, `agentrl.weightsync.send`) and the receivers (engine workers,
`agentrl.rollout.vllm_worker`) compute the same bucket plan from the same tensor metadata and join the same
process group, so this module depends on neither side.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32" (strings pickle across processes and versions)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def meta_of(name: str, t: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[TensorMeta]]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes`, one dtype per bucket (a tensor larger
    than the limit gets its own bucket). Sender and receivers compute the same plan from the same metas."""
    buckets: list[list[TensorMeta]] = []
    cur: list[TensorMeta] = []
    size = 0
    for m in metas:
        nbytes = m.numel * torch.empty((), dtype=m.torch_dtype).element_size()
        if cur and (size + nbytes > bucket_bytes or cur[0].dtype != m.dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(m)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def pack_bucket(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat contiguous buffer holding the bucket's tensors back to back (into `out` when given)."""
    flat = [t.detach().reshape(-1) for t in tensors]
    return torch.cat(flat) if out is None else torch.cat(flat, out=out)


class PackBuffer:
    """One flat buffer the sender reuses for every bucket of every sync. A fresh 256 MiB allocation per bucket
    paid page faults that cost far more than the copy into it (measured on CPU: 0.23 s against 0.03 s to pack
    400 MB)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buf = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def unpack_bucket(flat: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat`, named and shaped as the sender's tensors (what `model.load_weights` takes)."""
    out, offset = [], 0
    for m in metas:
        out.append((m.name, flat[offset : offset + m.numel].view(m.shape)))
        offset += m.numel
    return out


class SyncError(RuntimeError):
    """A weight sync that failed on the weight-sync group (an engine died or hung in it): the sync fails, the
    process that raises it stays usable and drops the group, and the next sync builds a new one."""


# How the NCCL / HCCL watchdog of a weight-sync group handles a timeout or a peer's error: 2 (CleanUpOnly) aborts
# that group's communicators and leaves the process alone. torch's default (3, SkipCleanUp) and torch_npu's
# TearDown (1) take the whole process down: right for the training group, where a rank that goes on alone would
# compute garbage, wrong for this one, whose peers are engines that may die (and are restarted) at any time.
# Both read the variable when a group is constructed, so setting it around the construction is per group (a
# user's setting for the training group is left as it was).
_ERROR_HANDLING_VARS = {"nccl": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "hccl": "HCCL_ASYNC_ERROR_HANDLING"}
_CLEAN_UP_ONLY = "2"
_env_lock = threading.Lock()


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    with _env_lock:
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def new_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0):
    """A process group over a fresh TCPStore (rank 0 hosts it), independent of any default group, so trainer
    rank 0 and engine workers living in other process groups can share it. backend: gloo | nccl | hccl.

    `timeout_s` is the group's own: joining it and every collective on it fail after that long. With NCCL / HCCL
    the group is built to abort only itself on a timeout or a peer's death (not the process: see
    `_ERROR_HANDLING_VARS`)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0), timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":  # checked only on a device; built as torch's own new_group builds it
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        with _env(_ERROR_HANDLING_VARS["nccl"], _CLEAN_UP_ONLY):
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":  # checked only on a device; torch_npu exists only where an NPU does
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        with _env(_ERROR_HANDLING_VARS["hccl"], _CLEAN_UP_ONLY):
            return ProcessGroupHCCL(store, rank, world_size, options)
    raise ValueError(f"unknown weight-sync backend {backend!r} (known: gloo, nccl, hccl)")


def wait(work, timeout_s: float | None) -> None:
    """Wait for one collective of a weight-sync group, at most `timeout_s`. On NCCL / HCCL a wait with a timeout
    blocks this thread until the collective ends (a plain wait only orders streams and would let a dead peer
    hang the device's stream), and on a timeout aborts the group's communicator and raises."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


def free_port(ports: tuple[int, int] | None = None) -> int:
    """A port this node can listen on: any free one (`ports` None), or the first free one in the inclusive
    range `ports` (rollout.weight_sync_ports: the one(s) a firewall between the nodes lets through)."""
    import socket

    candidates = [0] if ports is None else range(ports[0], ports[1] + 1)
    for port in candidates:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds (a port in TIME_WAIT)
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise SyncError(
        f"rollout.weight_sync_ports: no free port in {ports[0]}-{ports[1]} on trainer rank 0's node "
        "(each run's weight-sync group holds one): widen the range"
    )


@dataclass(frozen=True)
class SyncGroup:
    """Where the weight-sync group meets. The driver makes a new one (a new port) whenever the set of engines
    changes; both ends keep their group while the address stays the same."""

    addr: str
    port: int
    world_size: int
    backend: str
    timeout_s: float = 600.0

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.addr, self.port, self.world_size)


class GroupCache:
    """One live weight-sync group per process, replaced (and the old one shut down) when the address changes, and
    dropped (aborted) after a failed sync, so that the next sync builds a new one even at the same address."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._group = None
        # delta sync (agentrl.weightsync.delta): each bucket's content as of the last sync in this group; a new group
        # starts without, so its first sync is full on both ends
        self.bases: dict[int, torch.Tensor] = {}

    def get(self, where: SyncGroup, rank: int):
        if self._key != (*where.key, rank):
            self.close()
            self._group = new_group(where.backend, where.addr, where.port, rank, where.world_size, where.timeout_s)
            self._key = (*where.key, rank)
        return self._group

    def fail(self) -> None:
        """Drop the group after a failure in it: abort it (NCCL / HCCL: its communicators, which may be stuck on
        a dead peer; a clean shutdown would wait for them) and forget it."""
        group, self._group, self._key = self._group, None, None
        self.bases = {}
        _end(group, "abort")

    def close(self) -> None:
        """Drop the group; NCCL/HCCL communicators hold device memory until shut down."""
        group, self._group, self._key = self._group, None, None
        self.bases = {}
        _end(group, "shutdown")


def _end(group, how: str) -> None:
    end = getattr(group, how, None)
    if end is not None:
        try:
            end()
        except Exception:  # a group whose peers died may fail to end cleanly; it is dropped either way
            pass
