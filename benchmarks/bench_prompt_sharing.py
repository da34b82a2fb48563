"""The trainer's RL step on a turn-wise batch three ways, interleaved in one process (1 rank, gloo, 1 thread):
every row whole (`plain`), each distinct prompt once with every answer on a copy of its KV cache (`row`, the
flash-attention layout), and each distinct prompt once with its answers side by side under a tree mask (`tree`,
what SDPA models run).

    python benchmarks/bench_prompt_sharing.py [--groups 16] [--rounds 4]

The batch mimics Sokoban's turn-wise samples: every prompt starts with the same 65-token rules, each group of 8
episodes plays one level whose ~13 states (40-46 more tokens each) the episodes revisit (the first state in
every episode), ~11 turns per episode, 5-token answers. Prints one JSON object with the median step seconds of
each and the ratios (target: tree faster than row). The machine is shared: only the ratios measured side by side
in one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import time

import torch

import agentrl.trainer.prompt_sharing as sharing
from agentrl.config.schema import Config
from agentrl.models.tiny import resolve_model_path
from agentrl.trainer.worker import TrainerRank
from agentrl.types import Sample


def step_wise_batch(groups: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    rules = [rng.randint(3, 500) for _ in range(65)]
    out = []
    for g in range(groups):
        states = [[rng.randint(3, 500) for _ in range(rng.randint(40, 46))] for _ in range(13)]
        for e in range(8):
            turns = rng.randint(4, 15)
            for t in range(turns):
                state = states[0] if t == 0 else states[min(int(rng.expovariate(0.3)), 12)]
                answer = [rng.randint(3, 500) for _ in range(4)] + [2]
                toks = rules + state + answer
                mask = [0] * (len(toks) - 5) + [1] * 5
                reward = float(rng.random() < 0.4)
                out.append(Sample(toks, mask, [-1.0 * m for m in mask], [0] * len(toks), reward, f"g{g}", f"g{g}e{e}"))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = Config()
    cfg.trainer.micro_batch_tokens = 16384
    cfg.trainer.algorithm.mini_batches = 4
    rank = TrainerRank(cfg.model_dump(mode="json", by_alias=True), resolve_model_path(cfg.model.path), 0, 1)
    rank.setup("127.0.0.1", _free_port())
    samples = step_wise_batch(args.groups)
    tree_pass, min_shared = sharing._takes_custom_masks, sharing.MIN_SHARED_TOKENS
    ways = {
        "plain": lambda: setattr(sharing, "MIN_SHARED_TOKENS", 10**9),
        "row": lambda: setattr(sharing, "_takes_custom_masks", lambda _model: False),
        "tree": lambda: None,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    rank.train_step(samples)  # warm-up
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for way in order:
            ways[way]()
            t0 = time.perf_counter()
            rank.train_step(samples)
            times[way].append(time.perf_counter() - t0)
            sharing._takes_custom_masks, sharing.MIN_SHARED_TOKENS = tree_pass, min_shared
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "benchmark": "prompt_sharing",
        "samples": len(samples),
        "distinct_prompts": len({tuple(s.token_ids[:-5]) for s in samples}),
        "tokens": sum(len(s.token_ids) for s in samples),
        "step_s": {k: round(v, 3) for k, v in med.items()},
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "row_over_tree": round(med["row"] / med["tree"], 3),
        "plain_over_tree": round(med["plain"] / med["tree"], 3),
    }))  # fmt: skip
    rank.shutdown()


if __name__ == "__main__":
    main()
