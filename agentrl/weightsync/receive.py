"""The receiving end of the collective weight sync (an engine worker; `agentrl.rollout.vllm_worker` loads what it
yields into vLLM). Its sender is `agentrl.weightsync.send`."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentrl.weightsync.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, plan_buckets, unpack_bucket, wait
from agentrl.weightsync.delta import receive_bucket, receive_repairs


def receive_state_dict(
    group,
    metas: list[TensorMeta],
    device: torch.device,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float | None = None,
    bases: dict[int, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver (an engine worker): yields (name, tensor) per bucket as it arrives, ready for `load_weights`.
    Each bucket waits at most `timeout_s` (on NCCL / HCCL a plain wait would not block, and a sender that died
    would leave the device's stream hung): a failure raises, so no partial load passes for a sync. With `bases`
    (this worker's group's `GroupCache.bases`), a delta sync (`agentrl.weightsync.delta`)."""
    buckets = plan_buckets(metas, bucket_bytes)
    drifted: list[bool] = []
    for i, bucket in enumerate(buckets):
        if bases is None:
            flat = torch.empty(sum(m.numel for m in bucket), dtype=bucket[0].torch_dtype, device=device)
            wait(group.broadcast(flat, 0), timeout_s)
        else:
            flat, drift = receive_bucket(group, bucket, i, bases, device, timeout_s)
            drifted.append(drift)
        yield from unpack_bucket(flat, bucket)
    if bases is not None:  # a bucket some receiver got wrong comes again whole: loaded again, over the wrong one
        for i, flat in receive_repairs(group, buckets, drifted, bases, device, timeout_s):
            yield from unpack_bucket(flat, buckets[i])
