"""Trainer step time and tokens/s for the tiny model at 1 and 2 FSDP2 ranks (Ray actors, gloo on CPU).

    python benchmarks/bench_trainer.py [--samples 128] [--steps 3] [--ranks 1 2] [--layouts pad packed]

The default batch mimics turn-wise Sokoban samples: ~112 prompt tokens + 8 answer tokens.
Prints one JSON line per setting. The machine is shared: re-run before trusting a number.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import ray

from agentrl.config.schema import Config
from agentrl.trainer import TrainerGroup
from agentrl.types import Sample


def batch(n: int, seed: int, prompt: tuple[int, int], answer: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(*prompt)
        toks = [rng.randint(3, 300) for _ in range(p + answer)]
        mask = [0] * p + [1] * answer
        lp = [-1.0 * m for m in mask]
        out.append(Sample(toks, mask, lp, [0] * len(toks), float(rng.random() < 0.4), f"g{i // 8}", f"e{i}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layouts", nargs="+", default=["pad", "packed"])
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--prompt", type=int, nargs=2, default=[100, 124])
    ap.add_argument("--answer", type=int, default=8)
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    for layout in args.layouts:
        for n in args.ranks:
            cfg = Config()
            cfg.trainer.num_ranks = n
            cfg.trainer.packing = layout
            cfg.trainer.micro_batch_tokens = args.micro_batch_tokens
            t0 = time.perf_counter()
            group = TrainerGroup(cfg)
            start_s = time.perf_counter() - t0
            try:
                group.train_step(batch(args.samples, 0, tuple(args.prompt), args.answer))  # warm-up
                times, tps = [], []
                for s in range(args.steps):
                    b = batch(args.samples, s + 1, tuple(args.prompt), args.answer)
                    t = time.perf_counter()
                    m = group.train_step(b)
                    times.append(time.perf_counter() - t)
                    tps.append(m["train/tokens"] / times[-1])
                t = time.perf_counter()
                group.export_weights("/dev/shm/agentrl-bench-export")
                export_s = time.perf_counter() - t
            finally:
                group.shutdown()
            print(
                json.dumps(
                    {
                        "layout": layout,
                        "ranks": n,
                        "samples": args.samples,
                        "tokens": m["train/tokens"],
                        "start_s": round(start_s, 2),
                        "step_s": round(statistics.median(times), 3),
                        "tokens_per_s": round(statistics.median(tps)),
                        "export_s": round(export_s, 3),
                    }
                ),
                flush=True,
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
