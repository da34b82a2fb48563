"""Accelerator weight sync: trainer rank 0 broadcasts the full weights to the engines in flat buckets.

On CPU the trainer writes a safetensors snapshot to /dev/shm and engines `reload_weights` it
(`TrainerGroup.export_weights`). On CUDA / Ascend that round trip through host memory is the slow part, so rank 0
and every engine worker join a separate process group (NCCL or HCCL, from the platform layer) built straight on a
TCPStore, independent of the trainer's default group, and rank 0 broadcasts the state dict bucket by bucket:
many small tensors packed into one flat buffer per bucket, so there are few large collectives instead of
hundreds of small ones.

Bucketing, packing and the group set-up are unit-tested on CPU over gloo (tests/test_trainer_weight_sync.py).
The NCCL / HCCL path and the vLLM worker extension are checked only on a device.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
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


def pack_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat contiguous buffer holding the bucket's tensors back to back."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack_bucket(flat: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat`, named and shaped as the sender's tensors (what `model.load_weights` takes)."""
    out, offset = [], 0
    for m in metas:
        out.append((m.name, flat[offset : offset + m.numel].view(m.shape)))
        offset += m.numel
    return out


def new_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0):
    """A process group over a fresh TCPStore (rank 0 hosts it), independent of any default group, so trainer
    rank 0 and engine workers living in other process groups can share it. backend: gloo | nccl | hccl."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0), timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":  # checked only on a device
        return dist.ProcessGroupNCCL(store, rank, world_size)
    if backend == "hccl":  # checked only on a device; torch_npu exists only where an NPU does
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]

        return ProcessGroupHCCL(store, rank, world_size)
    raise ValueError(f"unknown weight-sync backend {backend!r} (known: gloo, nccl, hccl)")


def broadcast_state_dict(
    group, state: dict[str, torch.Tensor], device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[TensorMeta]:
    """Sender (trainer rank 0, group rank 0). Receivers must get the returned metas first (e.g. through a Ray
    call) and run `receive_state_dict` with them. Returns the metas."""
    metas = [meta_of(k, v) for k, v in state.items()]
    for bucket in plan_buckets(metas, bucket_bytes):
        flat = pack_bucket([state[m.name] for m in bucket]).to(device)
        group.broadcast(flat, 0).wait()
    return metas


def receive_state_dict(
    group, metas: list[TensorMeta], device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver (an engine worker): yields (name, tensor) per bucket as it arrives, ready for `load_weights`."""
    for bucket in plan_buckets(metas, bucket_bytes):
        flat = torch.empty(sum(m.numel for m in bucket), dtype=bucket[0].torch_dtype, device=device)
        group.broadcast(flat, 0).wait()
        yield from unpack_bucket(flat, bucket)


class VLLMWeightSyncExtension:
    """vLLM worker extension (`worker_extension_cls="agentrl.trainer.weight_sync.VLLMWeightSyncExtension"`):
    engines call these through `collective_rpc`. Checked only on a device."""

    def init_weight_group(self, backend: str, addr: str, port: int, rank: int, world_size: int) -> None:
        self._agentrl_group = new_group(backend, addr, port, rank, world_size)

    def receive_weights(self, metas: list[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        device = next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]
        weights = receive_state_dict(self._agentrl_group, metas, device, bucket_bytes)
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(metas)
