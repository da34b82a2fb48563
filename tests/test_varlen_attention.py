"""agentrl's varlen attention (CUDA without flash-attn: packed micro-batches need no T x T mask), on CPU.

torch's `varlen_attn` is CUDA-only, so these tests run the plumbing around it (the transformers registration, the
sequence boundaries from the position ids, GQA, the decision that picks it and the memory plan that follows the
decision) with a stand-in for the kernel; the kernel itself runs in scripts/gpu_smoke.py's logprob_accuracy phase
(packed against pad) on a GPU node.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from agentrl.trainer import model as M
from agentrl.trainer import sharding as S
from agentrl.trainer import varlen_attention as VA
from agentrl.trainer.batching import collate

CPU_DEV = torch.device("cpu")


def reference_varlen_attn_standin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Stands in for torch's CUDA-only varlen_attn: per-sequence causal SDPA. Same signature as torch 2.12+'s
    (2.11's lacks enable_gqa: `standin_without_gqa`), causal only through window_size=(-1, 0) as there."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert query.dim() == 3 and key.dim() == 3  # [T, H, D]
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError("query and key/value heads differ without enable_gqa")
    bounds = cu_seq_q.tolist()
    assert max_q == max(b - a for a, b in itertools.pairwise(bounds))
    outs = []
    for a, b in itertools.pairwise(bounds):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))  # [H, L, D]
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=tuple(window_size) == (-1, 0), scale=scale, enable_gqa=enable_gqa
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def standin_without_gqa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """torch 2.11's signature (no enable_gqa): the attention must repeat the kv heads itself."""
    return reference_varlen_attn_standin(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
    )


@pytest.fixture(params=[reference_varlen_attn_standin, standin_without_gqa], ids=["torch2.12+", "torch2.11"])
def standin(request, monkeypatch) -> list[int]:
    """The stand-in as this process's varlen_attn; yields the sequence count of each call."""
    calls: list[int] = []

    def kernel(*args, **kwargs) -> torch.Tensor:
        calls.append(len(args[3]) - 1)  # sequences in the call
        return request.param(*args, **kwargs)

    kernel.__signature__ = inspect.signature(request.param)  # what the GQA check reads
    monkeypatch.setattr(VA, "torch_varlen_attn", lambda: kernel)
    VA._last_bounds[:] = [None, None]
    return calls


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def test_packed_rows_equal_sdpa_under_the_block_mask(standin) -> None:
    """Three sequences of different lengths in one row, 4 query heads over 2 kv heads (Qwen3's tiny shape):
    the varlen path equals transformers' SDPA with the dense block-diagonal mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    lengths = [5, 9, 3]
    packed = collate([list(range(1, n + 1)) for n in lengths], {}, "packed", 0)
    T, D = sum(lengths), 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (4, 2, 2))
    out, _ = VA.varlen_attention_forward(_Attn(), q, k, v, None, scaling=D**-0.5, position_ids=packed["position_ids"])
    ref, _ = sdpa_attention_forward(_Attn(), q, k, v, packed["attention_mask"], scaling=D**-0.5)
    assert out.shape == ref.shape == (1, T, 4, D)
    assert torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
    assert standin == [3]


def test_sequence_bounds_from_position_ids() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu, longest = VA.sequence_bounds(pos, 1, 9, CPU_DEV)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 9] and longest == 4
    rows = torch.tensor([[0, 1, 2], [0, 1, 2]])  # rows of equal length, no padding: one sequence per row
    assert VA.sequence_bounds(rows, 2, 3, CPU_DEV)[0].tolist() == [0, 3, 6]
    assert VA.sequence_bounds(None, 2, 3, CPU_DEV)[0].tolist() == [0, 3, 6]


def test_tiny_qwen3_packed_through_varlen_equals_pad_layout(tiny_model_path, standin) -> None:
    """The whole tiny Qwen3 (4 heads, 2 kv heads) run packed through the registered attention, collated as the
    worker collates for it (no block mask), gives the pad layout's log-probs under SDPA, and so does a padded
    micro-batch through it (SDPA's mask path)."""
    from tests.hf_models import load_causal_lm

    seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    masks = {"loss_mask": [[1.0] * len(s) for s in seqs]}
    sdpa = load_causal_lm(tiny_model_path, torch.float32, CPU_DEV).eval()
    pad = collate(seqs, masks, "pad", 0)
    with torch.no_grad():
        ref, _ = M.forward_logprobs(sdpa, pad, plan=None)
    VA.register()
    sdpa.config._attn_implementation = VA.VARLEN
    assert M.runs_varlen(sdpa)
    packed = collate(seqs, masks, "packed", 0, block_mask=not M.runs_varlen(sdpa))
    assert packed["attention_mask"].shape == (1, 15) and M.model_mask(sdpa, packed["attention_mask"]) is None
    with torch.no_grad():
        got, _ = M.forward_logprobs(sdpa, packed, plan=None)
        padded, _ = M.forward_logprobs(sdpa, pad, plan=None)
    assert standin and set(standin) == {3}  # every layer's attention went through the kernel, 3 sequences each
    for i, s in enumerate(seqs):
        row = ref[i, : len(s)]
        start = int(packed["starts"][i])
        assert torch.allclose(got[0, start : start + len(s)], row, atol=1e-5)
        assert torch.allclose(padded[i, : len(s)], row, atol=1e-5)
    assert standin == [3] * sdpa.config.num_hidden_layers  # the padded pass ran SDPA, not the kernel


@dataclass(frozen=True)
class FakePlatform:
    """Only what attn_implementation reads of agentrl.platform.Platform."""

    kind: str


def test_the_decision(monkeypatch) -> None:
    """CUDA + bf16 without flash-attn: torch's varlen kernel; with flash-attn: flash_attention_2; CPU, fp32, or a
    torch without varlen_attn: SDPA."""
    monkeypatch.setattr(VA, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(VA, "varlen_available", lambda: True)
    assert S.attn_implementation(FakePlatform("cuda"), torch.bfloat16) == VA.VARLEN
    from transformers import AttentionInterface

    assert VA.VARLEN in AttentionInterface._global_mapping  # registered by the choice
    assert S.attn_implementation(FakePlatform("cuda"), torch.float32) == "sdpa"
    assert S.attn_implementation(FakePlatform("cpu"), torch.bfloat16) == "sdpa"
    assert S.attn_implementation(FakePlatform("npu"), torch.bfloat16) == "flash_attention_2"
    monkeypatch.setattr(VA, "varlen_available", lambda: False)
    assert S.attn_implementation(FakePlatform("cuda"), torch.bfloat16) == "sdpa"
    monkeypatch.setattr(VA, "flash_attn_installed", lambda: True)
    assert S.attn_implementation(FakePlatform("cuda"), torch.bfloat16) == "flash_attention_2"
    assert VA.choose_attention("cuda", True, flash_attn=False, varlen=True) == VA.VARLEN


def test_varlen_attn_probe_accepts_torch_2_11_signature() -> None:
    """This torch (CPU build) has varlen_attn with keyword scale and window_size, as 2.11 does."""
    assert VA.varlen_available()


@pytest.mark.parametrize("packing", ["packed", "pad"])
def test_memory_plan_counts_the_mask_only_where_sdpa_takes_it(monkeypatch, packing) -> None:
    from agentrl import memory_plan as mp
    from agentrl.config import load_config

    cfg = load_config(None, [f"trainer.packing={packing}", "trainer.micro_batch_tokens=4096"])
    dims = mp.dims_for_params(500_000_000)
    monkeypatch.setattr(VA, "flash_attn_installed", lambda: False)

    def has_mask(platform: str, varlen: bool) -> bool:
        monkeypatch.setattr(VA, "varlen_available", lambda: varlen)
        comps = mp.trainer_plan(cfg, dims, platform != "cpu", platform).components
        return any(c.name == "packed mask" for c in comps)

    sdpa_packed = packing == "packed"
    assert has_mask("cpu", True) is sdpa_packed
    assert has_mask("cuda", False) is sdpa_packed  # no varlen kernel: SDPA with the dense mask
    assert not has_mask("cuda", True)  # the varlen kernel: no mask
    assert not has_mask("npu", False)  # flash_attention_2 on Ascend
