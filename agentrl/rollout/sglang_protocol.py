"""SGLang's generate wire format, shared by the in-process SGLang engine and the remote HTTP backend.

The JSON of SGLang's native POST /generate (input_ids, sampling_params, return_logprob -> output_ids,
meta_info.output_token_logprobs, meta_info.finish_reason) is also what `sglang.Engine.async_generate` takes and
returns, so one mapping serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import Completion, EngineError, finish_reason


def sglang_sampling(s: SamplingConfig, eos: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang's sampling_params dict (its names: max_new_tokens, sampling_seed; top_k=-1 means off)."""
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "stop_token_ids": sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos))),
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop / EOS token: the trainer must see every sampled token
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    return params


def sglang_request(token_ids: list[int], s: SamplingConfig, request_id: str, eos: Sequence[int] = ()) -> dict[str, Any]:
    """Fields of `Engine.async_generate(**...)` and of the JSON body of POST /generate."""
    return {
        "input_ids": list(token_ids),
        "sampling_params": sglang_sampling(s, eos),
        "return_logprob": True,
        "rid": request_id,
    }


def parse_sglang_output(out: dict[str, Any]) -> Completion:
    """Tokens, their log-probs and the finish reason from one SGLang generate result.

    meta_info.output_token_logprobs is a list of (logprob, token_id, text-or-None); output_ids, when present,
    must agree with it.
    """
    meta = out.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) if p[0] is not None else float("nan") for p in pairs]
    if out.get("output_ids") is not None and [int(t) for t in out["output_ids"]] != ids:
        raise EngineError(f"SGLang output_ids and output_token_logprobs disagree for request {meta.get('id')}")
    return ids, logprobs, finish_reason(meta.get("finish_reason"))
