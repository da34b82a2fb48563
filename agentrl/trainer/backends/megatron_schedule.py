"""Micro-batches through Megatron-Core's schedules (`get_forward_backward_func`) for `MegatronBackend`.

Megatron runs the loss inside its schedule: no pipelining at PP 1, the non-interleaved 1F1B schedule at PP > 1,
where only the last stage sees the model output and the earlier ones send activations forward and gradients back.
Here the worker's `loss_fn` becomes the schedule's loss function, with `config.calculate_per_token_loss` set so
Megatron neither divides the loss by the micro-batch count nor DDP averages over replicas: a loss that is its
micro-batch's share of the global loss gives the global loss's gradient. The last stage's per-micro-batch results
are then broadcast over the pipeline group, so every rank of the replica gets them (advantages on every rank,
metric sums reaching global rank 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from agentrl.trainer.backends import Batch, LossFn

# (model, batch) -> (this stage's output, last stage: output -> (per-token result [rows, T], entropies or None))
StepFn = Callable[[Any, Batch], tuple[torch.Tensor, Callable]]


def run_schedule(
    step: StepFn, model, batches: Sequence[Batch], loss_fn: LossFn | None, forward_only: bool, device: torch.device
) -> list[Any]:
    """Forward (and backward) of every micro-batch through Megatron's schedule; per micro-batch, on every rank:
    `loss_fn`'s detached sums, or the per-token result without a `loss_fn`."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    results: list[Any] = []
    shapes: list[tuple[int, ...]] = []
    one = torch.ones((), dtype=torch.int)  # the "token count" Megatron adds up; unused (no finalize func)

    def forward_step(data_iterator, mdl):
        batch = next(data_iterator)
        shapes.append(tuple(batch["input_ids"].shape))
        out, post = step(mdl, batch)

        def loss_func(output):
            per_token, ent = post(output)
            if loss_fn is None:
                results.append(per_token.detach())
                return per_token.sum() * 0.0, one, {}
            loss, sums = loss_fn(batch, per_token, ent)
            results.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in sums.items()})
            return loss, one, {}

        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=1,  # shapes travel with each activation (mbridge sets variable_seq_lengths)
        micro_batch_size=1,
        forward_only=forward_only,
    )
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return results
    src, group = mpu.get_pipeline_model_parallel_last_rank(), mpu.get_pipeline_model_parallel_group()
    last = mpu.is_pipeline_last_stage()
    if loss_fn is None:
        return _broadcast_tensors(results if last else None, shapes, src, group, device)
    box = [
        [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in r.items()} for r in results] if last else None
    ]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type != "cpu" else None)
    return box[0]


def _broadcast_tensors(tensors, shapes, src: int, group, device: torch.device) -> list[torch.Tensor]:
    """The last stage's float32 [rows, T] results, one per micro-batch, in one broadcast (every stage knows
    the shapes from its own batches)."""
    sizes = [math.prod(s) for s in shapes]
    if tensors is not None:
        flat = torch.cat([t.float().reshape(-1) for t in tensors])
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=src, group=group)
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]
