"""The critic model, FSDP2 wrapping, and per-token forward passes of HF causal LMs (built by `sharding`).

Per-token results are aligned with `token_ids` like `Sample.logprobs`: position t holds log pi(token_t |
tokens before t), computed from the logits at t - 1; position 0 of every sequence holds 0
(nothing predicts it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from agentrl.trainer.losses import MODEL_DIST, SamplingDist, token_logprobs
from agentrl.trainer.prompt_sharing import SharingPlan, plan_sharing, shared_logits
from agentrl.trainer.varlen_attention import reads_packed_boundaries


class ValueModel(nn.Module):
    """The GAE critic: the policy's backbone (initialised from the same checkpoint) with a scalar head."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone
        self.model.config.use_cache = False
        p = next(backbone.parameters())
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=p.dtype, device=p.device)
        if p.device.type != "meta":
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        # A fresh tensor, not a view: FSDP2 hooks the root's output for backward.
        return self.value_head(h.last_hidden_state).squeeze(-1).clone()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (the modules HF marks as not to be split), each becoming one FSDP2 unit."""
    inner = getattr(model, "model", model)
    names = set(getattr(inner, "_no_split_modules", None) or getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers and hasattr(inner, "layers"):
        layers = list(inner.layers)
    return layers


def apply_fsdp2(model: nn.Module) -> nn.Module:
    """fully_shard every decoder layer and then the root (embeddings, final norm, tied LM head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def _shift_align(x: torch.Tensor) -> torch.Tensor:
    """[B, T-1, ...] computed from logits at t-1 -> [B, T, ...] with zeros at position 0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)


def loss_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Token positions any row of the micro-batch trains on (loss_mask), or None for every position.

    Turn-wise samples train on ~5 answer tokens after ~110 prompt tokens: the LM head and softmax over the
    vocabulary at the other positions would be wasted work (measured 1.6x step time on the tiny model).
    """
    mask = batch.get("loss_mask")
    if mask is None:
        return None
    cols = torch.nonzero(mask.any(dim=0)).flatten()
    return cols if cols.numel() else torch.ones(1, dtype=torch.long, device=mask.device)


def _accepts(model: nn.Module, arg: str) -> bool:
    return arg in _forward_params(type(model))


@functools.cache
def _forward_params(cls: type) -> frozenset[str]:
    """Parameter names of a model class's forward, inspected once per class (not per micro-batch)."""
    import inspect

    return frozenset(inspect.signature(cls.forward).parameters)


def attention_of(model: nn.Module) -> str:
    """The model's transformers attention implementation ("" when it has none)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
    return getattr(config, "_attn_implementation", None) or ""


def runs_varlen(model: nn.Module) -> bool:
    """Whether `model`'s attention reads a packed row's sequences from the position ids (flash-attention, or
    agentrl's varlen attention: `varlen_attention`), so that a packed micro-batch needs no T x T mask."""
    return reads_packed_boundaries(attention_of(model))


def model_mask(model: nn.Module, mask: torch.Tensor) -> torch.Tensor | None:
    """The attention mask to hand the model. A packed row's [1, 1, T, T] block-diagonal mask is only the SDPA
    fallback: varlen models (`runs_varlen`) get None and run variable-length attention, the sequence boundaries
    read from where the position ids restart. For them the worker collates packed rows without the block mask
    (`collate(block_mask=False)`: a [1, T] mask, no T x T tensor at all), and a single row has no padding, so
    both become None. Padded [rows, T] masks of several rows pass unchanged."""
    if not runs_varlen(model):
        return mask
    return None if mask.dim() == 4 or mask.shape[0] == 1 else mask


def shares_prompts(model: nn.Module, grad: bool) -> bool:
    """Whether `causal_logits` can run repeated prompts once for this model (`prompt_sharing`): it needs HF's
    `logits_to_keep` and a KV cache, and no activation checkpointing while grads flow (the backward replay would
    append the shared tokens' KV to the cache again)."""
    recomputes = grad and getattr(model, "recomputes_layers", False)
    return _accepts(model, "logits_to_keep") and _accepts(model, "past_key_values") and not recomputes


def sharing_plan(model: nn.Module, batch: dict[str, torch.Tensor]) -> SharingPlan | None:
    """How `causal_logits` may run `batch`'s repeated prompts once under `model` (None: the plain pass)."""
    if not shares_prompts(model, torch.is_grad_enabled()):
        return None
    return plan_sharing(batch)


def causal_logits(
    model: nn.Module, batch: dict[str, torch.Tensor], positions: torch.Tensor, plan: SharingPlan | None
) -> torch.Tensor:
    """Logits [rows, len(positions), vocab] at `positions` (sorted) of each row.

    Two savings, both exact: the LM head runs only at `positions` (HF's `logits_to_keep`), and prompts rows
    repeat run once (`plan`, from `sharing_plan`). Rows get zeros at positions before their first loss token
    there.
    """
    ids, mask, pos = batch["input_ids"], model_mask(model, batch["attention_mask"]), batch["position_ids"]
    if not _accepts(model, "logits_to_keep"):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return out.logits[:, positions]
    if plan is None:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=positions)
        return out.logits
    return shared_logits(model, batch, positions, plan)


def forward_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    with_entropy: bool = False,
    sampling_dist: SamplingDist = MODEL_DIST,
    entropy_grad: bool = True,
    plan: SharingPlan | str | None = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of batch['input_ids'] under `model`, aligned with the tokens.

    With a `loss_mask` in the batch only its tokens are computed (every other position holds 0); without, all.
    `sampling_dist`: of which distribution: the model's own, or the one the engines sample from (temperature,
    top-k, top-p: `SamplingDist`). `plan`: how to run repeated prompts once ("auto": `sharing_plan`; None: the
    plain pass).
    """
    ids = batch["input_ids"]
    targets = loss_positions(batch)
    if targets is None:
        targets = torch.arange(1, ids.shape[1], device=ids.device)
    logits = causal_logits(model, batch, targets - 1, sharing_plan(model, batch) if isinstance(plan, str) else plan)
    d = sampling_dist
    logp, ent = token_logprobs(
        logits, ids[:, targets], d.temperature, with_entropy, entropy_grad, top_p=d.top_p, top_k=d.top_k
    )
    if "loss_mask" in batch:  # a column some row trains on holds other rows' non-loss tokens
        keep = batch["loss_mask"][:, targets] > 0
        logp = torch.where(keep, logp, logp.new_zeros(()))
        ent = torch.where(keep, ent, ent.new_zeros(())) if ent is not None else None
    zeros = logp.new_zeros(ids.shape)
    ent = zeros.index_copy(1, targets, ent) if ent is not None else None
    return zeros.index_copy(1, targets, logp), ent


def forward_values(critic: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(state before token t) at position t: the critic's output at t - 1, aligned like the log-probs."""
    v = critic(batch["input_ids"], model_mask(critic, batch["attention_mask"]), batch["position_ids"])
    return _shift_align(v[:, :-1].float())
