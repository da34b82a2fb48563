"""The sender of the collective weight broadcast: trainer rank 0 sends the full weights in flat buckets.

Today weights reach the engines as a safetensors snapshot that each engine reloads (`TrainerGroup.export_weights`,
written to /dev/shm on CPU), on every platform: nothing in the pipeline calls this module yet. It is the
collective path the multi-node work will wire, where the round trip through host memory is the slow part: rank 0
and every engine worker join a separate process group (gloo, NCCL or HCCL, from the platform layer) built
straight on a TCPStore, independent of the trainer's default group, and rank 0 broadcasts the state dict bucket
by bucket, many small tensors packed into one flat buffer per bucket, so there are few large collectives
instead of hundreds of small ones. The receiving side is `agentrl.rollout.vllm_worker`; the bucket format both
ends share is `agentrl.weight_buckets`.

Bucketing, packing and a two-process broadcast are unit-tested on CPU over gloo; the NCCL / HCCL groups and the
vLLM receiver are checked only on a device.
"""

from __future__ import annotations

import torch

from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES, TensorMeta, meta_of, pack_bucket, plan_buckets


def broadcast_state_dict(
    group, state: dict[str, torch.Tensor], device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[TensorMeta]:
    """Sender (trainer rank 0, group rank 0). Receivers must get the same metas first (e.g. through a Ray
    call) and run `agentrl.rollout.vllm_worker.receive_state_dict` with them. Returns the metas."""
    metas = [meta_of(k, v) for k, v in state.items()]
    for bucket in plan_buckets(metas, bucket_bytes):
        flat = pack_bucket([state[m.name] for m in bucket]).to(device)
        group.broadcast(flat, 0).wait()
    return metas
