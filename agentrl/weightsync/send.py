"""The trainer's side of the collective weight sync: full weights streamed to the engine workers in flat buckets.

Trainer rank 0 and every engine worker join one process group (gloo on CPU, NCCL on CUDA, HCCL on Ascend) built
straight on a TCPStore that rank 0 hosts, beside the trainer's own default group. All trainer ranks walk the
backend's `full_weights` in step (each weight is gathered from its shards: FSDP2's all-gather, Megatron's
tensor/pipeline gathers); rank 0 casts each to the engines' dtype, packs it into the current bucket and
broadcasts the bucket when it is full. At most one bucket of full weights exists at a time, so a model that only
fits sharded still syncs, and no copy goes through host memory on an accelerator. The receiving end is
`agentrl.rollout.vllm_worker`; the bucket format both ends share is `agentrl.weightsync.buckets`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from agentrl.weightsync.buckets import (
    DEFAULT_BUCKET_BYTES,
    PackBuffer,
    SyncError,
    TensorMeta,
    pack_bucket,
    plan_buckets,
    wait,
)
from agentrl.weightsync.delta import send_bucket, send_repairs


def weight_metas(metas: Iterable[tuple[str, Sequence[int], torch.dtype]], dtype: torch.dtype) -> list[TensorMeta]:
    """What the receivers allocate: names and global shapes, floating tensors in the engines' dtype."""
    return [
        TensorMeta(k, tuple(shape), str(dtype if t.is_floating_point else t).removeprefix("torch."))
        for k, shape, t in metas
    ]


def stream_weights(
    full: Iterable[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffer: PackBuffer | None = None,
    sender: bool | Callable[[], bool] = True,
) -> Iterator[torch.Tensor | None]:
    """Per bucket: the packed flat bucket on the sender's device, in `buffer` when given (each bucket overwrites
    the previous one: send it before taking the next); None on the other ranks (`sender=False`), which only take
    part in the gathers. `sender` may be a callable, asked before each bucket (a sender whose send failed stops
    packing but still walks the gathers). `full` yields the weights in `metas` order; every rank must run it to
    the end."""
    sending = sender if callable(sender) else (lambda: sender)
    weights = iter(full)
    for bucket in plan_buckets(metas, bucket_bytes):
        send = sending()
        parts = []
        for m in bucket:
            name, t = next(weights)
            if name != m.name:
                raise RuntimeError(f"weight order changed: got {name}, expected {m.name}")
            parts.append(t.to(m.torch_dtype) if send else None)
        if not send:
            yield None
            continue
        size = sum(m.numel for m in bucket)
        out = None if buffer is None else buffer.take(size, bucket[0].torch_dtype, parts[0].device)
        yield pack_bucket(parts, out)


def broadcast_weights(
    group,
    full: Iterable[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffer: PackBuffer | None = None,
    timeout_s: float | None = None,
    bases: dict[int, torch.Tensor] | None = None,
) -> int:
    """Collective over the trainer ranks: the sender (rank 0 of `group` too) sends each bucket; the other ranks
    pass group None and only take part in the gathers. Returns the bytes sent. With `bases` (the sender's group's
    `GroupCache.bases`), a delta sync: each bucket travels as its changes since the last sync when that is
    smaller (`agentrl.weightsync.delta`).

    A failed send (an engine died or hung in the group: each bucket may take `timeout_s`) does not end the walk:
    the sender stops sending but takes part in every remaining gather, so the other trainer ranks, which cannot
    know, finish theirs and the trainer stays in step; then it raises `SyncError`."""
    sent, started = 0, time.monotonic()
    failures: list[str] = []  # the first failed send; asked before each bucket, so the walk goes on without sending
    buckets = len(plan_buckets(metas, bucket_bytes))

    def sending() -> bool:
        return group is not None and not failures

    device = None
    for i, flat in enumerate(stream_weights(full, metas, bucket_bytes, buffer, sending)):
        if flat is None:
            continue
        device = flat.device
        try:
            if bases is None:
                wait(group.broadcast(flat, 0), timeout_s)
                sent += flat.numel() * flat.element_size()
            else:
                sent += send_bucket(group, flat, i, bases, timeout_s)
        except Exception as err:  # the group's error (a peer's reset, a timeout): this sync fails, not the trainer
            failures.append(f"bucket {i + 1} of {buckets} after {time.monotonic() - started:.1f} s: {_first_line(err)}")
    if bases is not None and device is not None and not failures:
        try:  # the buckets a receiver got wrong, whole again
            sent += send_repairs(group, bases, buckets, device, timeout_s)
        except Exception as err:
            failures.append(f"the repair round after {time.monotonic() - started:.1f} s: {_first_line(err)}")
    if failures:
        raise SyncError(f"weight broadcast to the engines failed at {failures[0]}")
    return sent


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]
