"""HF <-> Megatron-Core conversion for the `megatron` backend, through mbridge (a maintained bridge).

mbridge builds every model with the Transformer Engine layer spec, and its name maps expect TE's fused
layer-norm weights (`linear_qkv.layer_norm_weight`). Without TE (CPU) the bridge here picks Megatron's local
spec, whose layer norms are modules of their own (`input_layernorm`, `pre_mlp_layernorm`), and maps those names.
The same bridge classes convert a `torch_dist` checkpoint to an HF directory without building the model
(`export_hf`). Also here: the forward-pass glue of the backend (packed rows, vocab-parallel log-probs and
entropy, the critic's value head).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.trainer.losses import MODEL_DIST, SamplingDist, token_logprobs

_LOCAL_NORMS = {
    ".input_layernorm.weight": "model.layers.{n}.input_layernorm.weight",
    ".pre_mlp_layernorm.weight": "model.layers.{n}.post_attention_layernorm.weight",
}


class _LocalSpecMixin:
    """Layer spec (TE or local), layer-norm names of the local spec, rope base from transformers 5 configs."""

    use_te: bool = False

    def _get_transformer_layer_spec(self, vp_stage=None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        if self.use_te:
            return super()._get_transformer_layer_spec(vp_stage)
        self.has_vp_stage = True
        return get_gpt_decoder_block_spec(
            self.config, use_transformer_engine=False, normalization=self.config.normalization, vp_stage=vp_stage
        )

    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        for suffix, hf in _LOCAL_NORMS.items():
            if name.startswith("decoder.layers.") and name.endswith(suffix):
                return [hf.format(n=name.split(".")[2])]
        return super()._weight_name_mapping_mcore_to_hf(name)

    def _get_gptmodel_args(self) -> dict:
        hf = self.hf_config
        if getattr(hf, "rope_theta", None) is None:
            rope = getattr(hf, "rope_parameters", None) or {}
            hf.rope_theta = rope.get("rope_theta", 10000.0)
        return super()._get_gptmodel_args()


def make_bridge(hf_path: str, dtype: torch.dtype, use_te: bool, parallel_states: Any = None, **extra: Any):
    """The mbridge bridge of the checkpoint's model type, choosing the layer spec; `extra` overrides the
    TransformerConfig (fusions, recomputation, sequence parallel)."""
    from mbridge.core.bridge import _MODEL_REGISTRY  # importing mbridge registers its model types
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_path)
    base = _MODEL_REGISTRY.get(hf_config.model_type)
    if base is None:
        raise ValueError(f"mbridge has no bridge for model type {hf_config.model_type!r}")
    cls = type(f"Agentrl{base.__name__}", (_LocalSpecMixin, base), {"use_te": use_te})
    if parallel_states is None:
        bridge = cls(hf_config, dtype=dtype)
    else:
        bridge = cls(hf_config, dtype=dtype, parallel_states=parallel_states)
    if extra:
        bridge.set_extra_args(**extra)
    return bridge


def local_layer_overrides() -> dict:
    """TransformerConfig fields that keep Megatron-Core off its CUDA-only kernels (no TE, no Apex)."""
    return {
        "use_cpu_initialization": True,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "cross_entropy_loss_fusion": False,
    }


def hf_metas(bridge, model: torch.nn.Module, tp_size: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, full shape, dtype) of this pipeline stage's weights in `bridge.export_weights` order, from the
    local shapes alone (meta tensors through the bridge's own split of fused qkv / gate-up)."""
    from mbridge.core.util import unwrap_model

    inner = unwrap_model(model)
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global(inner, consider_ep=False)
    out = []
    for name, p in inner.named_parameters():
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tp_size
        names, tensors = bridge._weight_to_hf_format(local_to_global[name], torch.empty(shape, device="meta"))
        out.extend((n, tuple(t.shape), p.dtype) for n, t in zip(names, tensors, strict=True))
    return out


# ----------------------------------------------------------------------------------------------------------
# Offline export: torch_dist checkpoint -> HF directory, in one process, without building the model.


def export_hf(ckpt_dir: str, out_dir: str, hf_path: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Write an HF model directory (config, tokenizer files, one safetensors file) from the policy's Megatron
    distributed checkpoint under `ckpt_dir` (as `MegatronBackend.save_checkpoint` writes it), in this process:
    no process group, no Megatron model. `hf_path`: the HF model the policy was built from (config, tokenizer),
    by default the one the checkpoint records in megatron.json. Sharded tensors are stored with their full
    global shapes, so torch DCP reads them whole at any TP/PP size; only names and fused layouts (qkv, gate/up)
    need converting, by the bridge's own functions.
    """
    import shutil

    from safetensors.torch import save_file

    if hf_path is None:
        with open(os.path.join(ckpt_dir, "megatron.json")) as fh:
            hf_path = json.load(fh)["hf_path"]
    bridge = _offline_bridge(hf_path)
    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, t in _read_dcp(os.path.join(ckpt_dir, "policy")):
        for hf_name, hf_t in zip(*bridge._weight_to_hf_format(name, t), strict=True):
            if tied and hf_name == "lm_head.weight":
                continue
            out[hf_name] = (hf_t.to(dtype) if dtype is not None else hf_t).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(hf_path):
        if f.endswith((".json", ".jinja", ".txt", ".model")) and not f.startswith("model.safetensors"):
            shutil.copy(os.path.join(hf_path, f), os.path.join(out_dir, f))
    if dtype is not None:
        with open(os.path.join(out_dir, "config.json")) as fh:
            cfg = json.load(fh)
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(out_dir, "config.json"), "w") as fh:
            json.dump(cfg, fh, indent=2)


def _read_dcp(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The model tensors of a Megatron torch_dist checkpoint, whole, under per-layer Megatron names.

    Megatron stores each decoder-layer tensor stacked over the layers ("decoder.layers.<name>", leading axis =
    global layer number), TP-split tensors in their full TP-1 layout, and local-spec layer norms under TE's names
    (`linear_qkv.layer_norm_weight`): exactly what the bridge's HF conversion takes after unstacking.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.") and "_extra_state" not in k
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    for k, v in state.items():
        if k.startswith("decoder.layers."):
            rest = k[len("decoder.layers.") :]
            for i in range(v.shape[0]):
                yield f"decoder.layers.{i}.{rest}", v[i]
        else:
            yield k, v


def _offline_bridge(hf_path: str):
    """A bridge for name/layout conversion only: single-rank parallel states, no process group needed."""
    from mbridge.core.parallel_states import ParallelStates

    return make_bridge(hf_path, torch.float32, use_te=False, parallel_states=ParallelStates())


# ----------------------------------------------------------------------------------------------------------
# Forward-pass glue for MegatronBackend.


def add_value_head(gpt: nn.Module, config) -> None:
    """The critic: the policy's backbone with a scalar head (zero-initialised as agentrl's HF ValueModel, so
    identical on every rank) in place of the LM head; replicated over TP, gathered over sequence parallelism."""
    from mbridge.utils.layer import LinearForLastLayer

    # The embedding is no longer an output weight: no stage may all-reduce it as one (the first stage too, or
    # finalize_model_grads waits there for the last stage's all-reduce).
    gpt.share_embeddings_and_output_weights = False
    if not gpt.post_process:  # an earlier pipeline stage: no output layer here
        return
    head = LinearForLastLayer(config.hidden_size, 1, config=config, bias=True).to(
        device=gpt.decoder.final_layernorm.weight.device, dtype=config.params_dtype
    )
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    gpt.output_layer = head


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    """Several sequences in one row: the 4D block mask, or (flash-attention collation) a [1, T] mask with the
    sequences' layout keys."""
    if batch["attention_mask"].dim() == 4:
        return True
    return batch["input_ids"].shape[0] == 1 and "lengths" in batch and len(batch["lengths"]) > 1


def block_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1, 1, T, T] bool, True = may attend: the collated block mask, or built from seq_ids."""
    mask = batch["attention_mask"]
    if mask.dim() == 4:
        return mask.bool()
    s = batch["seq_ids"][0]
    causal = torch.tril(torch.ones(s.numel(), s.numel(), dtype=torch.bool, device=s.device))
    return (causal & (s[:, None] == s[None, :]))[None, None]


def thd_params(batch: dict[str, torch.Tensor]):
    """PackedSeqParams of a packed row (sequences back to back from column 0, as `collate` lays them out)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = batch["lengths"].to(torch.int32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    cu = cu.to(batch["input_ids"].device)
    longest = int(lengths.max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


@contextmanager
def output_positions(gpt: nn.Module, positions: torch.Tensor | None):
    """Run the output layer only at `positions` of the [T, rows, hidden] states (HF's logits_to_keep):
    turn-wise samples train on a few answer tokens after a long prompt."""
    if positions is None:
        yield
        return

    def hook(_module, args, kwargs):
        return (args[0][positions], *args[1:]), kwargs

    handle = gpt.output_layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def rope_positions(gpt: nn.Module, positions: torch.Tensor):
    """Packed rows restart positions per sequence: RoPE at `position_ids` (one row) instead of 0..T-1."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None:
        yield
        return

    def hook(_module, _args, out):
        return out[positions[0].to(out.device)]

    handle = rope.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
    sampling_dist: SamplingDist = MODEL_DIST,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z)[target] and the entropy from this rank's vocabulary slice [..., V / tp] of the logits,
    reduced over the tensor-parallel group (no full-vocabulary tensor). Megatron's cross entropy subtracts the
    max in place, so it gets its own copy when the entropy's backward needs the logits too.

    Of `sampling_dist`: a temperature divides the logits; top-k / top-p need every logit of a row to find the kept
    set, so then the slices are gathered (a full-vocabulary tensor per micro-batch, its backward takes this
    rank's slice) and `token_logprobs` computes them, as the FSDP2 backend does."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if sampling_dist.truncates:
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        tp, d = mpu.get_tensor_model_parallel_world_size(), sampling_dist
        full = logits if tp == 1 else gather_from_tensor_model_parallel_region(logits)
        return token_logprobs(full, targets, d.temperature, with_entropy, entropy_grad, top_p=d.top_p, top_k=d.top_k)
    if sampling_dist.temperature != 1.0:
        logits = logits / sampling_dist.temperature
    ent = None
    if with_entropy:
        if entropy_grad:
            ent = _vocab_parallel_entropy(logits)
        else:
            with torch.no_grad():
                ent = _vocab_parallel_entropy(logits.detach())
    logp = -vocab_parallel_cross_entropy(logits.clone() if with_entropy and entropy_grad else logits, targets)
    return logp, ent


def _vocab_parallel_entropy(z: torch.Tensor) -> torch.Tensor:
    """H = log S + m - sum(e z) / S with e = exp(z - m), S = sum e over the whole vocabulary. The sums are
    all-reduced forward with an identity backward (every TP rank computes the same loss from them)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    m = z.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    e = torch.exp(z - m)
    s = reduce_from_tensor_model_parallel_region(e.sum(-1))
    w = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
    return torch.log(s) + m.squeeze(-1) - w / s
