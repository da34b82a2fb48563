"""Loading HF causal LMs (policy, reference, critic), wrapping them with FSDP2, and per-token forward passes.

Per-token results are aligned with `token_ids` like `Sample.logprobs`: position t holds log pi(token_t |
tokens before t), computed from the logits at t - 1; position 0 of every sequence holds 0
(nothing predicts it).
"""

from __future__ import annotations

import torch
from torch import nn


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An HF causal LM with SDPA attention (it takes the 4D block-diagonal masks of packed micro-batches)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device)


class ValueModel(nn.Module):
    """The GAE critic: the policy's backbone (initialised from the same checkpoint) with a scalar head."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
        self.model.config.use_cache = False
        self.value_head = nn.Linear(self.model.config.hidden_size, 1, dtype=dtype, device=device)
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

    Step-wise samples train on ~5 answer tokens after ~110 prompt tokens: the LM head and softmax over the
    vocabulary at the other positions would be wasted work (measured 1.6x step time on the tiny model).
    """
    mask = batch.get("loss_mask")
    if mask is None:
        return None
    cols = torch.nonzero(mask.any(dim=0)).flatten()
    return cols if cols.numel() else torch.ones(1, dtype=torch.long, device=mask.device)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def forward_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    with_entropy: bool = False,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of batch['input_ids'] under `model`, aligned with the tokens.

    With a `loss_mask` in the batch only the columns some row trains on are computed (the others hold 0);
    without, all of them.
    """
    ids = batch["input_ids"]
    targets = loss_positions(batch)
    if targets is None:
        targets = torch.arange(1, ids.shape[1], device=ids.device)
    kwargs = {}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = targets - 1  # the LM head runs at these positions only
    out = model(
        input_ids=ids,
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        **kwargs,
    )
    logits = out.logits if kwargs else out.logits[:, targets - 1]
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # once: the entropy reuses it
    logp = logp_all.gather(-1, ids[:, targets].unsqueeze(-1)).squeeze(-1)
    zeros = logp.new_zeros(ids.shape)
    ent = None
    if with_entropy:  # a metric unless entropy_grad (entropy bonus): then it needs the graph
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = zeros.index_copy(1, targets, -(logp_all.exp() * logp_all).sum(-1))
    return zeros.index_copy(1, targets, logp), ent


def forward_values(critic: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(state before token t) at position t: the critic's output at t - 1, aligned like the log-probs."""
    v = critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return _shift_align(v[:, :-1].float())
