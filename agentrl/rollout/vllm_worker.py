"""vLLM worker extension for agentrl engines (`worker_extension_cls`): runs inside vLLM's worker process.

`refresh_cpu_gemm`: vLLM-CPU prepacks linear weights (oneDNN / sgl-kernel handles) when a model loads. An
in-place `reload_weights` refreshes the layers whose weights it re-processes but not the prepacked handle of a
lm_head tied to the input embedding: that head keeps computing logits from the *old* embedding (measured:
greedy tokens looked right, sampled tokens were near-uniform noise). Re-dispatching every layer that still holds
its weight fixes it; layers whose weights vLLM removed after packing were re-packed by the reload itself.

On an accelerator every reload runs as vllm-ascend's own weight update does (v0.23.0
vllm_ascend/worker/worker.py: NPUWorker.start_weight_update, update_weights, finish_weight_update): under the
worker's device as torch's default device (`with torch.device(self.device)`: the layerwise reload re-creates the
layers' tensors, which would otherwise land on the CPU), then `torch.npu.synchronize()` (HCCL broadcasts and the
copies into the model are asynchronous on the device: the next step must see the new weights), and on Ascend only
with VLLM_ASCEND_ENABLE_NZ=0 (NPUWorker._check_nz_disabled; the engine sets it, `agentrl.platform`).

`receive_weights`: the receiving end of the collective weight sync (`agentrl.weightsync`).
Each worker (one per tensor-parallel rank) joins the group as rank `first_rank + self.rank`, receives every
bucket in full and hands the tensors to vLLM's in-place `reload_weights`, whose weight loaders keep this rank's
shard.
With `adapters` (trainer.lora, sync: adapter) the broadcast also (or only) holds LoRA adapter tensors under peft's
names: the worker writes them as a peft adapter dir (its local rank 0, on the engine's node) for the engine's
`add_lora`, and reloads only the base weights, if any came.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from agentrl.weightsync.adapters import is_adapter_tensor, write_adapter
from agentrl.weightsync.buckets import GroupCache, SyncGroup, TensorMeta
from agentrl.weightsync.receive import receive_state_dict


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

    def reload_from_path(self, weights_path: str) -> None:
        """The disk weight sync: the model runner's in-place reload from a safetensors folder. Called here, not as
        the worker's own `reload_weights`, which some builds lack (vllm-ascend 0.23's NPUWorker)."""
        with self._reloading():
            self.model_runner.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]

    def _device(self) -> torch.device:
        """The worker's device: vLLM's workers keep it as `device` (NPUWorker.init_device: "KEEP device the member
        of NPUWorker"); else where the model's weights are."""
        device = getattr(self, "device", None)
        if hasattr(device, "type"):
            return device
        return next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]

    @contextmanager
    def _reloading(self) -> Iterator[torch.device]:
        """Around an in-place reload on an accelerator, what vllm-ascend v0.23.0 does around its own
        (vllm_ascend/worker/worker.py, NPUWorker.start_weight_update / update_weights / finish_weight_update):
        refuse FRACTAL_NZ weights, load with the worker's device as the default device, then synchronize the
        device. The CPU reload runs as it is."""
        device = self._device()
        if device.type == "cpu":
            yield device
            return
        if device.type == "npu" and os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1").strip() != "0":
            # vllm-ascend's default is 1 (vllm_ascend/envs.py); the engine sets 0 for its workers
            raise ValueError(
                "FRACTAL_NZ mode is enabled (VLLM_ASCEND_ENABLE_NZ): an in-place weight reload would write "
                "checkpoint-layout tensors over NZ-layout weights; set VLLM_ASCEND_ENABLE_NZ=0"
            )
        with torch.device(device):
            yield device
        getattr(torch, device.type).synchronize()  # torch.npu / torch.cuda

    def receive_weights(
        self,
        group: dict,
        first_rank: int,
        metas: list,
        bucket_bytes: int,
        delta: bool = False,
        adapters: dict | None = None,
        adapter_dir: str = "",
    ) -> int:
        """Join (or reuse) the weight-sync group `group` (`SyncGroup` fields), receive every bucket and load it.
        `metas` are (name, shape, dtype) triples: plain values travel through vLLM's RPC on every version.
        `delta`: buckets may arrive as changes to the ones this worker received last in the same group.
        `adapters` (an adapter_config.json): adapter tensors go to `adapter_dir` instead of the model."""
        if not hasattr(self, "_agentrl_groups"):
            self._agentrl_groups = GroupCache()
        rank = first_rank + int(getattr(self, "rank", 0))
        where = SyncGroup(**group)
        device = self._device()
        wanted = [TensorMeta(name, tuple(shape), dtype) for name, shape, dtype in metas]
        try:
            pg = self._agentrl_groups.get(where, rank=rank)
            bases = self._agentrl_groups.bases if delta else None
            received = receive_state_dict(pg, wanted, device, bucket_bytes, where.timeout_s, bases)
            tensors: dict[str, torch.Tensor] = {}
            if adapters is not None:
                received = _set_aside_adapters(received, tensors)
            if adapters is None or any(not is_adapter_tensor(m.name) for m in wanted):
                # reload_weights, not model.load_weights: after loading, vLLM has processed (and on CPU, prepacked)
                # the layers and dropped their weight loaders; its in-place reload restores them around the load.
                # The buckets arrive while it loads (`received` is lazy), so they too run under _reloading.
                with self._reloading():
                    self.model_runner.reload_weights(weights_iterator=received)  # type: ignore[attr-defined]
            else:
                with self._reloading():
                    for _ in received:  # adapters only: every bucket still arrives
                        pass
        except Exception:  # the sender or another engine died in the group: drop (abort) it, the next sync rebuilds
            self._agentrl_groups.fail()
            raise
        if adapters is not None and int(getattr(self, "local_rank", getattr(self, "rank", 0))) == 0:
            write_adapter(adapter_dir, tensors, adapters)
        return len(wanted)


def _set_aside_adapters(received: Iterator, into: dict) -> Iterator:
    for name, tensor in received:
        if is_adapter_tensor(name):
            into[name] = tensor
        else:
            yield name, tensor
