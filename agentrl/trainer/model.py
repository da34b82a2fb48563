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


def forward_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    with_entropy: bool = False,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of batch['input_ids'] under `model`, aligned with the tokens."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch["input_ids"][:, 1:]
    logp_all = torch.log_softmax(logits, dim=-1)  # once: the entropy reuses it
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:  # a metric unless entropy_grad (entropy bonus): then it needs the graph
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = _shift_align(-(logp_all.exp() * logp_all).sum(-1))
    return _shift_align(logp), ent


def forward_values(critic: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(state before token t) at position t: the critic's output at t - 1, aligned like the log-probs."""
    v = critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return _shift_align(v[:, :-1].float())
