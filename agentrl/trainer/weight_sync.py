"""The trainer's side of the collective weight sync: full weights streamed to the engine workers in flat buckets.

Trainer rank 0 and every engine worker join one process group (gloo on CPU, NCCL on CUDA, HCCL on Ascend) built
straight on a TCPStore that rank 0 hosts, beside the trainer's own default group. All trainer ranks walk the
backend's `full_weights` in step (each weight is gathered from its shards: FSDP2's all-gather, Megatron's
tensor/pipeline gathers); rank 0 casts each to the engines' dtype, packs it into the current bucket and
broadcasts the bucket when it is full. At most one bucket of full weights exists at a time, so a model that only
fits sharded still syncs, and no copy goes through host memory on an accelerator. The receiving end is
`agentrl.rollout.vllm_worker`; the bucket format both ends share is `agentrl.weight_buckets`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES, PackBuffer, TensorMeta, pack_bucket, plan_buckets


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
    sender: bool = True,
) -> Iterator[torch.Tensor | None]:
    """Per bucket: the packed flat bucket on the sender's device, in `buffer` when given (each bucket overwrites
    the previous one: send it before taking the next); None on the other ranks (`sender=False`), which only take
    part in the gathers. `full` yields the weights in `metas` order; every rank must run it to the end."""
    weights = iter(full)
    for bucket in plan_buckets(metas, bucket_bytes):
        parts = []
        for m in bucket:
            name, t = next(weights)
            if name != m.name:
                raise RuntimeError(f"weight order changed: got {name}, expected {m.name}")
            parts.append(t.to(m.torch_dtype) if sender else None)
        if not sender:
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
) -> int:
    """Collective over the trainer ranks: the sender (rank 0 of `group` too) sends each bucket; the other ranks
    pass group None and only take part in the gathers. Returns the bytes sent."""
    sent = 0
    for flat in stream_weights(full, metas, bucket_bytes, buffer, sender=group is not None):
        if flat is not None:
            group.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
    return sent
