"""`agentrl make-model tiny OUT_DIR`: build the project's own tiny model and tokenizer."""

from __future__ import annotations

import argparse
import time

from agentrl.cli import UsageError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("make-model", parents=[common], help="build the tiny model + tokenizer into a directory")
    p.add_argument("kind", choices=["tiny"], help="model family to build")
    p.add_argument("out_dir", help="where the model dir is written")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--intermediate", type=int, default=None, help="FFN size (default 3x hidden)")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    p.add_argument("--vocab", type=int, default=1024, help="tokenizer vocabulary target")
    p.add_argument("--seed", type=int, default=0, help="seeds the random initial weights")
    p.set_defaults(func=_make_model)


def _make_model(args: argparse.Namespace) -> int:
    from agentrl.models.tiny import TinySpec, build_tiny_model

    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise UsageError("--hidden must divide by --heads, and --heads by --kv-heads")
    spec = TinySpec(
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate or 3 * args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        seed=args.seed,
    )
    start = time.perf_counter()
    out = build_tiny_model(args.out_dir, spec)
    print(f"built tiny model in {out} ({time.perf_counter() - start:.1f}s)")
    return 0
