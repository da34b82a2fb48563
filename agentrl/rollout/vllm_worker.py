"""vLLM worker extension for agentrl engines (`worker_extension_cls`): runs inside vLLM's worker process.

`refresh_cpu_gemm`: vLLM-CPU prepacks linear weights (oneDNN / sgl-kernel handles) when a model loads. An
in-place `reload_weights` refreshes the layers whose weights it re-processes but not the prepacked handle of a
lm_head tied to the input embedding: that head keeps computing logits from the *old* embedding (measured:
greedy tokens looked right, sampled tokens were near-uniform noise). Re-dispatching every layer that still holds
its weight fixes it; layers whose weights vLLM removed after packing were re-packed by the reload itself.

`init_weight_group` / `receive_weights`: the receiving end of the collective weight broadcast whose sender is
`agentrl.trainer.weight_sync`. The pipeline does not call them yet (engines reload safetensors snapshots);
they are the path the multi-node work will wire, and are checked only on a device.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES, TensorMeta, new_group, plan_buckets, unpack_bucket


def receive_state_dict(
    group, metas: list[TensorMeta], device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver (an engine worker): yields (name, tensor) per bucket as it arrives, ready for `load_weights`."""
    for bucket in plan_buckets(metas, bucket_bytes):
        flat = torch.empty(sum(m.numel for m in bucket), dtype=bucket[0].torch_dtype, device=device)
        group.broadcast(flat, 0).wait()
        yield from unpack_bucket(flat, bucket)


class AgentrlWorkerExtension:
    """Mixed into vLLM's worker (which supplies `model_runner`); engines call these through `collective_rpc`."""

    def refresh_cpu_gemm(self) -> int:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        refreshed = 0
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                refreshed += 1
        return refreshed

    def init_weight_group(self, backend: str, addr: str, port: int, rank: int, world_size: int) -> None:
        self._agentrl_group = new_group(backend, addr, port, rank, world_size)

    def receive_weights(self, metas: list[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        device = next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]
        weights = receive_state_dict(self._agentrl_group, metas, device, bucket_bytes)
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(metas)
