"""Variable-length attention for packed micro-batches on CUDA without the flash-attn package.

Why: the flash-attn package ships only an sdist on PyPI (no wheel for the pinned torch / CUDA, and no compiler on
an offline GPU node), so transformers' `flash_attention_2` is unavailable there, and SDPA needs a packed row's
sequence boundaries as a dense [1, 1, T, T] mask, which also keeps SDPA off its flash kernel. torch itself ships
flash attention's varlen kernel as `torch.nn.attention.varlen.varlen_attn` (2.11 on): registered here as the
transformers attention `agentrl_varlen`, a packed row runs as variable-length attention, its boundaries read from
where the position ids restart (what transformers' flash path does), and needs no T x T tensor at all.

Every other call (a padded batch, a KV-cache pass, a tree mask of the shared-prompt pass) has a dense mask and runs
through transformers' SDPA as before. `choose_attention` is the one decision of which attention a model gets; the
worker's collation (`model.runs_varlen`) and the memory plan's T x T mask both follow it.

Signatures read from torch's source: 2.11 has `varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
return_aux=None, scale=None, window_size=(-1, -1))` (query [T, H, D], key/value documented as [T, H, D]: no GQA
argument, so kv heads are repeated here); 2.12+ add `enable_gqa`. Both are causal only through
`window_size=(-1, 0)` (no `is_causal` argument); earlier releases (an `is_causal` argument, no `scale`) are not used.
The kernel is CUDA-only (bf16 / fp16): tests run the plumbing with a per-sequence SDPA stand-in.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

VARLEN = "agentrl_varlen"  # the transformers attn_implementation name
CAUSAL = (-1, 0)  # varlen_attn's window_size for causal attention (its only way to say it)


@functools.cache
def torch_varlen_attn() -> Callable | None:
    """torch's `varlen_attn` when this torch has one we can call (keyword `scale` and `window_size`: 2.11 on)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"scale", "window_size"} <= set(params) else None


def varlen_available() -> bool:
    return torch_varlen_attn() is not None


def flash_attn_installed() -> bool:
    """Whether transformers can run `flash_attention_2` (the flash-attn package, importable and usable)."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def choose_attention(kind: str, bf16: bool, flash_attn: bool | None = None, varlen: bool | None = None) -> str:
    """The attention implementation a trainer model gets on platform `kind` (cpu / cuda / npu).

    flash_attention_2 in bf16 on Ascend NPU (transformers routes it to torch_npu's fused attention) and on CUDA with
    the flash-attn package; on CUDA without it, torch's own varlen kernel (`VARLEN`); SDPA with dense masks
    otherwise (CPU, fp32, a torch without varlen_attn). `flash_attn` / `varlen`: None probes this process.
    """
    if not bf16 or kind not in ("cuda", "npu"):
        return "sdpa"
    if kind == "npu":
        return "flash_attention_2"
    if flash_attn if flash_attn is not None else flash_attn_installed():
        return "flash_attention_2"
    if varlen if varlen is not None else varlen_available():
        return VARLEN
    return "sdpa"


def reads_packed_boundaries(attn: str) -> bool:
    """Whether attention `attn` finds a packed row's sequences from its position ids (no T x T block mask)."""
    return attn.startswith("flash") or attn == VARLEN


def takes_dense_masks(attn: str) -> bool:
    """Whether `attn` runs any [rows, 1, q, k] mask (the shared-prompt tree pass): SDPA, and VARLEN through it."""
    return attn in ("sdpa", VARLEN)


def register() -> str:
    """Make `VARLEN` a transformers attention (and mask) implementation in this process; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)
    return VARLEN


def varlen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask for `VARLEN`: None where the attention can run varlen from the position ids (no cache,
    no padding: packed rows, or rows of equal length), else SDPA's mask (padding, a KV cache), built as for SDPA."""
    from transformers.masking_utils import sdpa_mask

    plain = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and kv_length == q_length
    if plain and (attention_mask is None or bool(attention_mask[:, -kv_length:].all())):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call: query [B, H, T, D], key / value [B, Hkv, S, D] -> ([B, T, H, D], None).

    A call with a mask (or queries after a cache) is SDPA's; a maskless one is causal attention within each
    sequence, the sequences starting where the position ids do not go on by one (row starts included)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, T, D = query.shape
    if attention_mask is not None or key.shape[2] != T:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window is not None or dropout:
        raise ValueError(
            f"{VARLEN} attention runs full causal attention without dropout (sliding_window={sliding_window}, "
            f"dropout={dropout}): set trainer.packing: pad for this model"
        )
    varlen_attn = torch_varlen_attn()
    if varlen_attn is None:
        raise RuntimeError(f"{VARLEN} attention needs torch.nn.attention.varlen.varlen_attn (torch >= 2.11)")
    cu_seq, max_len = sequence_bounds(position_ids, B, T, query.device)
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(B * T, H, D)
    k = key.transpose(1, 2).reshape(B * T, kv_heads, D)
    v = value.transpose(1, 2).reshape(B * T, kv_heads, value.shape[-1])
    gqa = {}
    if kv_heads != H:
        if _accepts_gqa(varlen_attn):
            gqa["enable_gqa"] = True
        else:  # 2.11: no GQA argument; query head h reads kv head h // (H / Hkv), as HF's repeat_kv lays them out
            k, v = k.repeat_interleave(H // kv_heads, dim=1), v.repeat_interleave(H // kv_heads, dim=1)
    causal = kwargs.get("is_causal")
    window = CAUSAL if (getattr(module, "is_causal", True) if causal is None else causal) else (-1, -1)
    out = varlen_attn(q, k, v, cu_seq, cu_seq, max_len, max_len, scale=scaling, window_size=window, **gqa)
    return out.reshape(B, T, H, out.shape[-1]), None


@functools.cache
def _accepts_gqa(varlen_attn: Callable) -> bool:
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


_last_bounds: list = [None, None]  # [(position_ids, rows, T), result]: every layer of a forward reads one tensor


def sequence_bounds(
    position_ids: torch.Tensor | None, rows: int, T: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [N + 1], longest sequence) of the rows flattened into one: a sequence starts at every row
    start and wherever the position ids do not go on by one (a packed row's next sample). Computed once per
    forward (one host sync), not once per layer."""
    key = _last_bounds[0]
    if position_ids is not None and key is not None and key[0] is position_ids and key[1:] == (rows, T):
        return _last_bounds[1]
    if position_ids is None:
        starts = torch.arange(0, rows * T, T, device=device)
    else:
        pos = position_ids.expand(rows, -1).reshape(-1)
        new = torch.ones_like(pos, dtype=torch.bool)
        new[1:] = pos[1:] != pos[:-1] + 1
        new[::T] = True
        starts = torch.nonzero(new).flatten()
    cu = torch.cat([starts, starts.new_tensor([rows * T])]).to(device=device, dtype=torch.int32)
    result = (cu, int((cu[1:] - cu[:-1]).max()))
    if position_ids is not None:
        _last_bounds[:] = [(position_ids, rows, T), result]
    return result
