"""The flat-bucket format of the collective weight broadcast, shared by its two ends.

The sender (trainer rank 0, `agentrl.weightsync.send`) and the receivers (engine workers,
`agentrl.rollout.vllm_worker`) compute the same bucket plan from the same tensor metadata and join the same
process group, so this module depends on neither side.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
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


# How the NCCL watchdog of a weight-sync group handles a timeout or a peer's error: 2 (CleanUpOnly) aborts that
# group's communicators and leaves the process alone. torch's default (3, SkipCleanUp) takes the whole process down:
# right for the training group, where a rank that goes on alone would compute garbage, wrong for this one, whose
# peers are engines that may die (and are restarted) at any time. NCCL reads the variable when a group is
# constructed, so setting it around the construction is per group (a user's setting for the training group is left
# as it was). HCCL groups are vllm-ascend's own communicator (`HcclGroup`), bounded by their own timeout.
_ERROR_HANDLING_VARS = {"nccl": "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
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

    `timeout_s` is the group's own: joining it and every collective on it fail after that long. With NCCL the
    group is built to abort only itself on a timeout or a peer's death (not the process: see
    `_ERROR_HANDLING_VARS`). HCCL: vllm-ascend's own communicator (`HcclGroup`)."""
    import torch.distributed as dist

    if backend == "hccl":
        return HcclGroup(addr, port, rank, world_size, timeout_s)
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
    raise ValueError(f"unknown weight-sync backend {backend!r} (known: gloo, nccl, hccl)")


class HcclGroup:
    """The HCCL weight-sync group, built as vllm-ascend builds its own for weight transfer (v0.23.0
    vllm_ascend/distributed/weight_transfer/hccl_engine.py: HCCLWeightTransferEngine._stateless_init_process_group,
    used by both ends, trainer_init and init_transfer_engine): vLLM's StatelessProcessGroup (a TCPStore that rank 0
    hosts, for the handshake only) and vllm-ascend's PyHcclCommunicator
    (vllm_ascend/distributed/device_communicators/pyhccl.py) on this process's current NPU. No torch process
    group is made, so neither torch_npu's ProcessGroupHCCL watchdog nor the process's default group is involved.

    It answers the two collectives this package calls on a torch process group, each returning a work for
    `wait`: the collective runs on a stream of its own (PyHcclCommunicator's calls are asynchronous on the stream
    they are given), so a peer that died leaves only that stream hung, and `wait` gives up after its timeout.
    vllm_ascend is imported lazily: it exists only where an NPU does."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.utils import StatelessProcessGroup  # type: ignore[import-not-found]
        from vllm_ascend.distributed.device_communicators.pyhccl import (  # type: ignore[import-not-found]
            PyHcclCommunicator,
        )

        npu = torch.npu  # type: ignore[attr-defined]  # registered by torch_npu, which vllm_ascend imports
        create = StatelessProcessGroup.create
        # store_timeout (seconds, vLLM >= 0.11): joining the group fails after the sync group's own timeout
        timeout = {"store_timeout": int(timeout_s)} if "store_timeout" in _parameters(create) else {}
        self._store = create(host=addr, port=port, rank=rank, world_size=world_size, **timeout)
        self._comm = PyHcclCommunicator(self._store, device=npu.current_device())
        self._stream = npu.Stream()

    def broadcast(self, tensor: torch.Tensor, root: int) -> _StreamWork:
        """Broadcast `tensor` in place from rank `root` (torch's ProcessGroup.broadcast(tensor, root))."""
        return self._run(lambda stream: self._comm.broadcast(tensor, src=root, stream=stream))

    def allreduce(self, tensor: torch.Tensor) -> _StreamWork:
        """Sum `tensor` in place over the group (PyHcclCommunicator's all_reduce returns a new tensor: copied back
        once it is done)."""
        out: list[torch.Tensor | None] = []
        work = self._run(lambda stream: out.append(self._comm.all_reduce(tensor, stream=stream)))
        return _StreamWork(work.event, lambda: out[0] is not None and tensor.copy_(out[0]))

    def _run(self, collective) -> _StreamWork:
        npu = torch.npu  # type: ignore[attr-defined]
        self._stream.wait_stream(npu.current_stream())  # after whatever filled the tensor
        collective(self._stream)
        event = npu.Event()
        event.record(self._stream)
        return _StreamWork(event)

    def abort(self) -> None:
        """Forget the communicator without destroying it: HcclCommDestroy would wait for a collective stuck on
        a dead peer (HCCL itself fails that one after HCCL_EXEC_TIMEOUT)."""
        self._comm = None

    def shutdown(self) -> None:
        """Destroy the communicator (it holds device memory)."""
        comm, self._comm = self._comm, None
        if comm is not None and not getattr(comm, "disabled", True):
            comm.hccl.hcclCommDestroy(comm.comm)


class _StreamWork:
    """A collective issued on a device stream, as torch's Work: `wait(timeout)` blocks until it is done on the
    device, at most `timeout`, then runs `then` (if any)."""

    def __init__(self, event, then=None) -> None:
        self.event = event
        self._then = then

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not self.event.query():
            if deadline is not None and time.monotonic() > deadline:
                raise SyncError(f"HCCL weight-sync collective not done after {timeout.total_seconds():g} s")
            time.sleep(0.001)
        if self._then is not None:
            self._then()
        return True


def _parameters(fn) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def wait(work, timeout_s: float | None) -> None:
    """Wait for one collective of a weight-sync group, at most `timeout_s`. On NCCL a wait with a timeout blocks
    this thread until the collective ends (a plain wait only orders streams and would let a dead peer hang the
    device's stream), and on a timeout aborts the group's communicator and raises; HCCL's `_StreamWork` alike."""
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
