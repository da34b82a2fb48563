"""The trainer's side of the collective weight sync: full weights streamed to the engine workers in flat buckets.

Trainer rank 0 and every engine worker join one process group (gloo on CPU, NCCL on CUDA, HCCL on Ascend) built
straight on a TCPStore that rank 0 hosts, beside the trainer's own default group. All trainer ranks walk the
sharded parameters in one order and gather each in full (FSDP2's all-gather), rank 0 casts it to the engines'
dtype, packs it into the current bucket and broadcasts the bucket when it is full. At most one bucket of full
weights exists at a time, so a model that only fits sharded still syncs, and no copy goes through host memory on
an accelerator. The receiving end is `agentrl.rollout.vllm_worker`; the bucket format both ends share is
`agentrl.weight_buckets`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES, PackBuffer, TensorMeta, pack_bucket, plan_buckets


def sharded_named_params(model: torch.nn.Module, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under HF names (FSDP and activation-checkpoint wrappers stripped), still sharded; a
    tied lm_head is left out (the engine re-ties it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return [(k, v) for k, v in state.items() if not (tied and k == "lm_head.weight")]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor (every rank must call it, in the same order): the whole tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def weight_metas(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[TensorMeta]:
    """What the receivers allocate: names and global shapes, floating tensors in the engines' dtype."""
    return [
        TensorMeta(k, tuple(v.shape), str(dtype if v.is_floating_point() else v.dtype).removeprefix("torch."))
        for k, v in named
    ]


def stream_weights(
    named: list[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffer: PackBuffer | None = None,
) -> Iterator[torch.Tensor | None]:
    """Per bucket: the packed flat bucket on rank 0's device, in `buffer` when given (each bucket overwrites the
    previous one: send it before taking the next); None on the other ranks, which only take part in the gathers.
    Every rank must run it to the end."""
    import torch.distributed as dist

    by_name = dict(named)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for bucket in plan_buckets(metas, bucket_bytes):
        parts = [full_tensor(by_name[m.name]).to(m.torch_dtype) for m in bucket]
        if not rank0:
            yield None
            continue
        out = (
            None
            if buffer is None
            else buffer.take(sum(m.numel for m in bucket), bucket[0].torch_dtype, parts[0].device)
        )
        yield pack_bucket(parts, out)


def broadcast_weights(
    group,
    named: list[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffer: PackBuffer | None = None,
) -> int:
    """Collective over the trainer ranks: rank 0 (rank 0 of `group` too) sends each bucket; the other ranks pass
    group None and only take part in the gathers. Returns the bytes rank 0 sent."""
    sent = 0
    for flat in stream_weights(named, metas, bucket_bytes, buffer):
        if flat is not None:
            group.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
    return sent
