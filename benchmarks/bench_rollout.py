"""Rollout throughput: the Ray engine actor + router against a raw in-process AsyncLLM, same prompts, same run.

Prints one JSON object. `ratio` = median tokens/s through actor + router / median raw tokens/s (target >= 0.95):
the price of Ray actors, the router and our bookkeeping on top of vLLM. Both engines use the same engine
arguments (in-process vLLM, float32 and eager on CPU). They run one after the other, never at the same time,
after one warm-up round each; rounds alternate so machine noise hits both alike.

    python benchmarks/bench_rollout.py --prompts 64 --tokens 128 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    return p.parse_args()


async def _raw_round(llm: Any, prompts: list[list[int]], tokens: int, tag: str) -> tuple[int, float]:
    from vllm import SamplingParams as VSP

    sp = VSP(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)

    async def one(i: int, prompt: list[int]) -> int:
        final = None
        async for out in llm.generate({"prompt_token_ids": prompt}, sp, request_id=f"{tag}-{i}"):
            final = out
        return len(final.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts), time.perf_counter() - t0


async def _ray_round(router: Any, prompts: list[list[int]], tokens: int, tag: str) -> tuple[int, float]:
    from agentrl.config.schema import SamplingConfig

    sampling = SamplingConfig(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(router.generate.remote(f"{tag}-ep{i}", p, sampling, f"{tag}-{i}") for i, p in enumerate(prompts))
    )
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from agentrl.config.schema import RolloutConfig
    from agentrl.models.tiny import resolve_model_path
    from agentrl.rollout.fleet import EngineSpec, start_engines, start_router

    model = resolve_model_path(args.model)
    cfg = RolloutConfig(num_engines=1)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    t0 = time.perf_counter()
    raw = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True if cfg.enforce_eager is None else cfg.enforce_eager,  # None: eager on CPU
            max_model_len=cfg.max_model_len,
            seed=0,
            enable_prefix_caching=True,
        )
    )
    raw_start = time.perf_counter() - t0
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    t0 = time.perf_counter()
    engines = start_engines(EngineSpec(cfg, model))
    router = start_router(engines, cfg)
    ray_start = time.perf_counter() - t0

    await _raw_round(raw, prompts, args.tokens, "warm-raw")
    await _ray_round(router, prompts, args.tokens, "warm-ray")
    raw_tps: list[float] = []
    ray_tps: list[float] = []
    for r in range(args.rounds):
        for which in ("raw", "ray") if r % 2 == 0 else ("ray", "raw"):  # alternate the order: no position bias
            if which == "raw":
                n, dt = await _raw_round(raw, prompts, args.tokens, f"raw{r}")
                raw_tps.append(n / dt)
            else:
                n, dt = await _ray_round(router, prompts, args.tokens, f"ray{r}")
                ray_tps.append(n / dt)
            assert n == args.prompts * args.tokens, f"{which} round {r} returned {n} tokens"

    raw.shutdown()
    ray.shutdown()
    del raw
    raw_med, ray_med = statistics.median(raw_tps), statistics.median(ray_tps)
    return {
        "benchmark": "rollout_throughput",
        "model": args.model,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "tokens_per_prompt": args.tokens,
        "rounds": args.rounds,
        "raw_asyncllm_tokens_per_s": round(raw_med, 1),
        "actor_router_tokens_per_s": round(ray_med, 1),
        "ratio": round(ray_med / raw_med, 3),
        "ratio_best": round(max(ray_tps) / max(raw_tps), 3),
        "target_ratio": 0.95,
        "raw_rounds": [round(x, 1) for x in raw_tps],
        "actor_router_rounds": [round(x, 1) for x in ray_tps],
        "raw_start_s": round(raw_start, 1),
        "actor_start_s": round(ray_start, 1),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    args = _args()
    from agentrl.platform import detect

    # The same environment the engine actor gets (in-process vLLM, CPU threads), set before vLLM is imported.
    for key, value in detect().vllm_env().items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON
    print(json.dumps(asyncio.run(_run(args)), indent=2))


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from re-running the benchmark
    main()
