"""Seconds per weight sync, trainer -> vLLM-CPU engine, for the disk and collective paths, against one in-memory
copy of the same weights (issue 15; target: a collective sync within 2x of one copy).

    python benchmarks/bench_weight_sync.py [--models tiny 100m] [--syncs 5] [--copies 5]

Per model (the tiny builtin and a ~100M-parameter random Qwen3 of the same architecture, built into a temp dir):
1 trainer rank (FSDP2, gloo), 1 vLLM-CPU engine (float32), the router in front, `WeightSync.sync` end to end.
- in_memory_copy_s: on trainer rank 0, `copy_` of the full weights it holds (engine dtype) into preallocated
  tensors of the same shapes; median of --copies.
- collective_sync_s / disk_sync_s: median of --syncs `WeightSync.sync` calls after one warm-up sync.
- parts: the collective path taken apart (rank 0's broadcast vs the engine's receive + reload_weights, the
  trainer-side gather + cast + pack alone, refresh_cpu_gemm alone), the disk path (export alone, the engine's
  reload_weights from the snapshot alone), and the engine's reload_weights from tensors already in its memory
  (the floor of any path that loads through vLLM's in-place reload).
Trainer ranks and engines run with THP_MEM_ALLOC_ENABLE=1 (agentrl's CPU worker environment): without it, the
fresh buckets the receiver allocates per sync fault in page by page and the collective path took 2.5x longer.
The 100m model lives in a temp dir (removed at the end); the benchmark's engine allows vLLM to receive a pickled
function (VLLM_ALLOW_INSECURE_SERIALIZATION=1) for the in-memory reload probe.
Prints one JSON object, also as the last line of stdout. The machine is shared: re-run before trusting a number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from agentrl.rollout.vllm_engine import VLLMEngine

MODELS = ("tiny", "100m")
# ~101M parameters: 16 layers x (attention 1.57M + MLP 4.72M) + a 1k-token tied embedding.
SPEC_100M = {"layers": 16, "hidden": 768, "intermediate": 2048, "heads": 12, "kv_heads": 4, "vocab": 1024}


class BenchEngine(VLLMEngine):
    """The agentrl vLLM engine plus one timed worker RPC (refresh_cpu_gemm, reload_weights from a path)."""

    async def timed_rpc(self, method: str, kwargs: dict | None = None) -> float:
        t0 = time.perf_counter()
        await self._llm.collective_rpc(method, kwargs=kwargs or {})
        return time.perf_counter() - t0

    async def worker_call(self, fn: Any, kwargs: dict) -> Any:
        """`fn(worker, **kwargs)` in vLLM's worker (the engine core process); the first worker's result."""
        return (await self._llm.collective_rpc(fn, kwargs=kwargs))[0]


def _reload_probe(worker: Any, path: str, repeats: int) -> dict[str, float]:
    """In the engine's worker: vLLM's reload_weights from tensors already in memory (the snapshot, read once), so
    neither the network nor the file system is in it; then refresh_cpu_gemm, as a sync does."""
    from safetensors.torch import load_file

    state: dict = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    reloads, refreshes = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.model_runner.reload_weights(weights_iterator=iter(list(state.items())))
        t1 = time.perf_counter()
        worker.refresh_cpu_gemm()
        reloads.append(t1 - t0)
        refreshes.append(time.perf_counter() - t1)
    return {
        "reload_weights_from_memory_s": statistics.median(reloads),
        "refresh_cpu_gemm_s": statistics.median(refreshes),
    }


# ---- run inside trainer rank 0 (TrainerRank.__ray_call__) ------------------------------------------------------


def _full_weights(rank: Any, dtype: str) -> list[tuple[str, Any]]:
    import torch

    cast = getattr(torch, dtype)
    return [(k, v.detach().to(cast)) for k, v in rank.backend.full_weights(rank.model, rank.tied)]


def _copy_probe(rank: Any, dtype: str, repeats: int) -> dict[str, Any]:
    """One copy of the full weights (what a sync moves) into preallocated tensors: median seconds."""
    import torch

    src = [v for _, v in _full_weights(rank, dtype)]
    dst = [torch.empty_like(v) for v in src]
    times = []
    for _ in range(repeats + 1):  # the first pass faults the destination pages in
        t0 = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        times.append(time.perf_counter() - t0)
    return {
        "seconds": statistics.median(times[1:]),
        "first_s": times[0],
        "params": sum(v.numel() for v in src),
        "bytes": sum(v.numel() * v.element_size() for v in src),
        "tensors": len(src),
        "torch_threads": torch.get_num_threads(),
    }


def _pack_probe(rank: Any, dtype: str, bucket_bytes: int, repeats: int) -> dict[str, Any]:
    """The sender's work without the network: gather (full_tensor) + cast + pack every bucket, median seconds."""
    import torch

    from agentrl.weightsync.send import stream_weights, weight_metas

    metas = weight_metas(rank.backend.weight_metas(rank.model, rank.tied), getattr(torch, dtype))
    times, buckets = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        full = rank.backend.full_weights(rank.model, rank.tied)
        buckets = sum(1 for _ in stream_weights(full, metas, bucket_bytes))
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "buckets": buckets}


# ---- one model -------------------------------------------------------------------------------------------------


def _cfg(mode: str, name: str):
    from agentrl.config import load_config

    return load_config(None, ["rollout.num_engines=1", "trainer.num_ranks=1", f"rollout.weight_sync={mode}",
                              f"name={name}-{mode}"])  # fmt: skip


async def _collective_parts(sync: Any, trainer: Any, router: Any, version: int) -> dict[str, float]:
    """One collective sync done by hand as WeightSync._sync_collective does it (the group it built is reused),
    timing when rank 0's broadcast returns and when the engine has loaded."""
    from agentrl.weightsync.buckets import DEFAULT_BUCKET_BYTES

    t0 = time.perf_counter()
    plan = await router.weight_sync_members.remote()
    dtype = plan["dtype"] or "float32"
    members = await router.hold.remote(plan["members"], sync.drain)
    assert members == sync._members, "the engine set changed: the probe would need a new group"
    source = {"group": asdict(sync._group), "metas": sync._metas["model"], "bucket_bytes": DEFAULT_BUCKET_BYTES}
    t1 = time.perf_counter()
    done: dict[str, float] = {}

    async def stamp(name: str, ref: Any) -> Any:
        out = await ref
        done[name] = time.perf_counter() - t1
        return out

    updated = router.update_weights.remote(source, version, sync.drain, members)
    sent = trainer.broadcast_weights_async(source["group"], dtype, DEFAULT_BUCKET_BYTES)
    engine_s, _ = await asyncio.gather(stamp("updated", updated), stamp("sent", sent))
    return {
        "total_s": time.perf_counter() - t0,
        "plan_and_hold_s": t1 - t0,
        "rank0_broadcast_s": done["sent"],  # gather + cast + pack + gloo sends, as rank 0 sees it
        "engine_update_s": engine_s,  # the engine's update_weights: receive + reload_weights + refresh_cpu_gemm
        "engine_done_after_rank0_s": done["updated"] - done["sent"],
    }


async def measure(model: str, path: str, syncs: int, copies: int) -> dict[str, Any]:
    from agentrl.config.schema import RolloutConfig
    from agentrl.platform import CPU
    from agentrl.rollout.fleet import EngineSpec, engine_kwargs, engine_options, start_router
    from agentrl.run.weights import WeightSync
    from agentrl.trainer import TrainerGroup
    from agentrl.weightsync.buckets import DEFAULT_BUCKET_BYTES

    out: dict[str, Any] = {"model_path": path}
    rcfg = RolloutConfig(num_engines=1)
    t0 = time.perf_counter()
    options, kwargs = engine_options(rcfg, CPU, None, 0), engine_kwargs(EngineSpec(rcfg, path))
    # worker_call sends a function to vLLM's engine core process (pickled): only this benchmark's engine allows it
    options["runtime_env"]["env_vars"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = ray.remote(BenchEngine).options(**options).remote(**kwargs)
    await engine.start.remote()
    router = start_router([engine], rcfg)
    trainer = TrainerGroup(_cfg("collective", f"bench-ws-{model}"), path)
    out["start_s"] = round(time.perf_counter() - t0, 2)
    rank0 = trainer.ranks[0]
    try:
        dtype = (await router.weight_sync_members.remote())["dtype"] or "float32"
        copy = await rank0.__ray_call__.remote(_copy_probe, dtype, copies)
        out.update(params=copy["params"], bytes=copy["bytes"], tensors=copy["tensors"], dtype=dtype)
        out["in_memory_copy_s"] = copy["seconds"]
        out["in_memory_copy_first_s"] = copy["first_s"]
        out["copy_gb_per_s"] = copy["bytes"] / copy["seconds"] / 1e9
        out["trainer_torch_threads"] = copy["torch_threads"]
        version = 0
        parts: dict[str, Any] = {}
        for mode in ("collective", "disk"):
            sync = WeightSync(_cfg(mode, f"bench-ws-{model}"), trainer, router, CPU)
            try:
                sync.check([engine])
                version += 1
                t = time.perf_counter()
                await sync.sync(version)  # warm-up: builds the group (collective)
                out[f"{mode}_warmup_s"] = time.perf_counter() - t
                times = []
                for _ in range(syncs):
                    version += 1
                    t = time.perf_counter()
                    await sync.sync(version)
                    times.append(time.perf_counter() - t)
                out[f"{mode}_sync_s"] = statistics.median(times)
                out[f"{mode}_sync_all_s"] = times
                if mode == "collective":
                    probes = []
                    for _ in range(syncs):
                        version += 1
                        probes.append(await _collective_parts(sync, trainer, router, version))
                    parts["collective"] = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
                    pack = await rank0.__ray_call__.remote(_pack_probe, dtype, DEFAULT_BUCKET_BYTES, syncs)
                    parts["collective"]["rank0_gather_cast_pack_s"] = pack["seconds"]
                    parts["collective"]["buckets"] = pack["buckets"]
                    parts["collective"]["refresh_cpu_gemm_s"] = statistics.median(
                        [await engine.timed_rpc.remote("refresh_cpu_gemm") for _ in range(syncs)]
                    )
                else:
                    snapshot = str(sync.root / f"v{version}")
                    exports, reloads = [], []
                    for _ in range(syncs):
                        t = time.perf_counter()
                        await asyncio.to_thread(trainer.export_weights, snapshot, dtype)
                        exports.append(time.perf_counter() - t)
                        reloads.append(await engine.timed_rpc.remote("reload_weights", {"weights_path": snapshot}))
                    await engine.timed_rpc.remote("refresh_cpu_gemm")  # the tied head again matches the embedding
                    parts["disk"] = {
                        "rank0_export_s": statistics.median(exports),
                        "engine_reload_weights_s": statistics.median(reloads),
                    }
                    probe = await engine.worker_call.remote(_reload_probe, {"path": snapshot, "repeats": syncs})
                    parts["engine"] = probe
            finally:
                sync.close()
        copy_s = out["in_memory_copy_s"]
        out["collective_vs_copy"] = out["collective_sync_s"] / copy_s
        out["disk_vs_copy"] = out["disk_sync_s"] / copy_s
        out["collective_vs_disk"] = out["collective_sync_s"] / out["disk_sync_s"]
        out["target_collective_vs_copy"] = 2.0
        out["meets_target"] = out["collective_vs_copy"] <= 2.0
        out["parts"] = parts
    finally:
        trainer.shutdown()
        for handle in (engine, router):
            with contextlib.suppress(Exception):
                ray.kill(handle)
    return out


LORA_WAYS = (("collective", "merged"), ("collective", "adapter"), ("disk", "adapter"))


async def measure_lora(model: str, path: str, syncs: int, rank: int) -> dict[str, Any]:
    """trainer.lora at `rank`, one LoRA-serving vLLM-CPU engine: seconds and bytes per `WeightSync.sync` for the
    merged weights (collective) and the adapters alone (collective; disk), medians after the first sync (which
    for adapters also brings the base)."""
    from agentrl.config import load_config
    from agentrl.platform import CPU
    from agentrl.rollout.fleet import EngineSpec, start_engines, start_router
    from agentrl.run.weights import WeightSync
    from agentrl.trainer import TrainerGroup

    def cfg(mode: str, how: str):
        return load_config(None, ["rollout.num_engines=1", "trainer.num_ranks=1", f"trainer.lora.rank={rank}",
                                  f"trainer.lora.sync={how}", f"rollout.weight_sync={mode}",
                                  f"name=bench-lora-{model}-{mode}-{how}"])  # fmt: skip

    base_cfg = cfg("collective", "adapter")
    engines = start_engines(EngineSpec(base_cfg.rollout, path, lora=base_cfg.trainer.lora))
    router = start_router(engines, base_cfg.rollout)
    trainer = TrainerGroup(base_cfg, path)
    out: dict[str, Any] = {"rank": rank}
    version = 0
    try:
        for mode, how in LORA_WAYS:  # merged first: an adapter sync leaves the engine serving an adapter
            sync = WeightSync(cfg(mode, how), trainer, router, CPU)
            try:
                sync.check(engines)
                times, sent = [], []
                for _ in range(syncs + 1):
                    version += 1
                    t = time.perf_counter()
                    n = await sync.sync(version)
                    times.append(time.perf_counter() - t)
                    if n is None:  # disk: the bytes of the files this sync wrote (the first one: the base too)
                        dirs = [sync.root / f"v{version}", *([Path(sync._base)] if len(sent) == 0 else [])]
                        n = sum(f.stat().st_size for d in dirs for f in d.iterdir())
                    sent.append(n)
                out[f"{mode}_{how}"] = {
                    "first_s": times[0],
                    "first_bytes": sent[0],
                    "sync_s": statistics.median(times[1:]),
                    "bytes": statistics.median(sent[1:]),
                }
            finally:
                sync.close()
        merged = out["collective_merged"]
        for way in ("collective_adapter", "disk_adapter"):
            out[f"{way}_vs_merged"] = {"seconds": out[way]["sync_s"] / merged["sync_s"],
                                       "bytes": out[way]["bytes"] / merged["bytes"]}  # fmt: skip
    finally:
        trainer.shutdown()
        for handle in [*engines, router]:
            with contextlib.suppress(Exception):
                ray.kill(handle)
    return out


def lora_bytes_at_half_a_billion(rank: int) -> dict[str, Any]:
    """Bytes per sync for Qwen2.5-0.5B's shapes in bf16 (counted, not timed): merged weights vs rank-`rank`
    adapters on every linear of each layer (agentrl's default target_modules)."""
    from agentrl.memory_plan import ModelDims

    dims = ModelDims("Qwen2.5-0.5B", hidden=896, layers=24, vocab=151_936, intermediate=4864, heads=14, kv_heads=2,
                     head_dim=64, tied=True, qkv_bias=True)  # fmt: skip
    adapters = dims.lora_params(rank, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return {"params": dims.params, "adapter_params": adapters, "merged_bytes": 2 * dims.params,
            "adapter_bytes": 2 * adapters, "bytes_ratio": adapters / dims.params}  # fmt: skip


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


# ---- full vs delta buckets: the codec over a gloo group, no engine ------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "agentic_sokoban.yaml")
EXAMPLE_BATCH = os.path.join(REPO, "tests", "data", "batches", "agentic_sokoban.jsonl.gz")
# Qwen2.5-0.5B's shapes (494M parameters, the embedding tied): random bf16 values
QWEN_05B = {"layers": 24, "hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "vocab": 151936}


def _bf16_weights(rank: Any) -> dict[str, Any]:
    """In trainer rank 0: the full weights as the engines would get them (bf16)."""
    import torch

    return {k: v.detach().to(torch.bfloat16).clone() for k, v in rank.backend.full_weights(rank.model, rank.tied)}


def training_steps(lr: float, steps: int) -> list[dict[str, Any]]:
    """The tiny model's bf16 weights before and after each of `steps` RL steps of the default example (its config at
    learning rate `lr`, its recorded real batch, the FSDP2 trainer): what consecutive checkpoints hold."""
    from agentrl.config import load_config
    from agentrl.run.batch_files import load_batch
    from agentrl.trainer import TrainerGroup

    cfg = load_config(EXAMPLE, [f"trainer.optim.lr={lr}", "trainer.optim.warmup_steps=0", f"name=bench-ws-lr{lr:g}"])
    samples = load_batch(EXAMPLE_BATCH)
    trainer = TrainerGroup(cfg, model_path("tiny", ""))
    try:
        states = [ray.get(trainer.ranks[0].__ray_call__.remote(_bf16_weights))]
        for _ in range(steps):
            trainer.train_step(samples)
            states.append(ray.get(trainer.ranks[0].__ray_call__.remote(_bf16_weights)))
    finally:
        trainer.shutdown()
    return states


def changed_fraction(before: dict[str, Any], after: dict[str, Any]) -> float:
    from agentrl.weightsync.delta import bits

    changed = sum(int((bits(after[k]) != bits(before[k])).sum()) for k in before)
    return changed / sum(t.numel() for t in before.values())


def qwen_shapes(spec: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, inter = spec["hidden"], spec["intermediate"]
    kv = h // spec["heads"] * spec["kv_heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec["vocab"], h))]
    for i in range(spec["layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                   (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (inter, h)),
                   (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]  # fmt: skip
    return [*shapes, ("model.norm.weight", (h,))]


def _align(group: Any) -> None:
    import torch

    group.allreduce(torch.zeros(1)).wait()


def _codec_receiver(port: int, metas: list, schedule: list[str], queue: Any) -> None:
    """An engine worker's receiving end (receive_state_dict), timed per sync from a common start."""
    import torch

    from agentrl.weightsync.buckets import DEFAULT_BUCKET_BYTES, new_group
    from agentrl.weightsync.delta import checksum
    from agentrl.weightsync.receive import receive_state_dict

    torch.set_num_threads(1)
    group = new_group("gloo", "127.0.0.1", port, 1, 2, timeout_s=600)
    bases: dict = {}
    for mode in schedule:
        _align(group)
        t0 = time.perf_counter()
        got = list(receive_state_dict(group, metas, torch.device("cpu"), DEFAULT_BUCKET_BYTES, 600,
                                      bases if mode == "delta" else None))  # fmt: skip
        seconds = time.perf_counter() - t0
        queue.put((seconds, [checksum(t.contiguous().view(-1)) for _, t in got]))


def codec_case(states: Any, steps: int) -> dict[str, Any]:
    """Per step, the same weights synced twice to one receiver process over gloo: full buckets, then delta buckets
    (against the delta path's own bases). `states(i)` gives the weights at step i (0: the warm-up, a full sync both
    ways). Seconds from a common start to the receiver holding every tensor; bytes broadcast by the sender."""
    import multiprocessing as mp

    from agentrl.weightsync.buckets import DEFAULT_BUCKET_BYTES, PackBuffer, meta_of, new_group
    from agentrl.weightsync.delta import checksum
    from agentrl.weightsync.send import broadcast_weights

    first = states(0)
    metas = [meta_of(k, v) for k, v in first]
    schedule = ["full", "delta"] * (steps + 1)
    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_codec_receiver, args=(port, metas, schedule, queue), daemon=True)
    proc.start()
    out: dict[str, Any] = {"params": sum(m.numel for m in metas), "dtype": metas[0].dtype}
    try:
        group = new_group("gloo", "127.0.0.1", port, 0, 2, timeout_s=600)
        buffer, bases = PackBuffer(), {}
        rows: dict[str, list[tuple[float, float, int]]] = {"full": [], "delta": []}
        for step in range(steps + 1):
            named = first if step == 0 else states(step)
            sums = [checksum(t.contiguous().view(-1)) for _, t in named]
            for mode in ("full", "delta"):
                _align(group)
                t0 = time.perf_counter()
                sent = broadcast_weights(group, named, metas, DEFAULT_BUCKET_BYTES, buffer, 600,
                                         bases if mode == "delta" else None)  # fmt: skip
                sender_s = time.perf_counter() - t0
                receiver_s, got = queue.get(timeout=600)
                assert got == sums, f"{mode} sync at step {step}: the receiver's weights differ from the sender's"
                if step:
                    rows[mode].append((receiver_s, sender_s, sent))
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    for mode, r in rows.items():
        out[mode] = {"seconds": statistics.median(x[0] for x in r), "sender_s": statistics.median(x[1] for x in r),
                     "bytes": statistics.median(x[2] for x in r)}  # fmt: skip
    out["delta_vs_full_seconds"] = out["delta"]["seconds"] / out["full"]["seconds"]
    out["delta_vs_full_bytes"] = out["delta"]["bytes"] / out["full"]["bytes"]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_delta(steps: int, lrs: list[float], big: bool) -> dict[str, Any]:
    """Full vs delta buckets: on the tiny model's real consecutive weights at each learning rate, and on a random
    ~0.5B model (Qwen2.5-0.5B's shapes) whose steps change the fraction of elements the tiny model's did."""
    import torch

    out: dict[str, Any] = {}
    fractions: dict[str, float] = {}
    for lr in lrs:
        states = training_steps(lr, steps)
        per_step = [changed_fraction(a, b) for a, b in itertools.pairwise(states)]
        fractions[f"{lr:g}"] = statistics.median(per_step[1:] or per_step)  # the first Adam step moves the most
        case = codec_case(lambda i, states=states: list(states[i].items()), steps)
        out[f"tiny_lr{lr:g}"] = {"changed_fraction_per_step": per_step, **case}
        print(f"delta tiny lr={lr:g}: {json.dumps(_rounded(out[f'tiny_lr{lr:g}']))}", file=sys.stderr, flush=True)
    if not big:
        return out
    shapes = qwen_shapes(QWEN_05B)
    for lr, fraction in fractions.items():
        g = torch.Generator().manual_seed(0)
        weights = [(name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)) for name, shape in shapes]

        def states(i: int, weights=weights, fraction=fraction, g=g) -> list[tuple[str, Any]]:
            for _, t in weights if i else ():  # a step: `fraction` of the elements move (by ~1%: a new bf16 value)
                moved = torch.rand(t.shape, generator=g) < fraction
                t[moved] = t[moved] * 1.01 + 1e-4
            return weights

        case = codec_case(states, steps)
        out[f"qwen0.5b_at_lr{lr}_fraction"] = {"changed_fraction": fraction, **case}
        print(f"delta 0.5b lr={lr}: {json.dumps(_rounded(out[f'qwen0.5b_at_lr{lr}_fraction']))}", file=sys.stderr,
              flush=True)  # fmt: skip
        del weights
    return out


def model_path(model: str, tmp: str) -> str:
    from agentrl.models.tiny import TinySpec, build_tiny_model, resolve_model_path

    if model == "tiny":
        return resolve_model_path("builtin:tiny")
    return str(build_tiny_model(os.path.join(tmp, model), TinySpec(**SPEC_100M)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--syncs", type=int, default=5, help="timed syncs per path (after one warm-up)")
    ap.add_argument("--copies", type=int, default=5, help="timed in-memory copies")
    ap.add_argument(
        "--cases", nargs="+", choices=("engine", "delta", "lora"), default=["engine", "delta", "lora"],
        help="engine: disk vs collective syncs into a vLLM engine; delta: full vs delta buckets; lora: merged "
        "weights vs adapters alone into a LoRA-serving vLLM engine",
    )  # fmt: skip
    ap.add_argument("--lora-rank", type=int, default=16, help="trainer.lora.rank of the lora cases")
    ap.add_argument("--delta-steps", type=int, default=3, help="training steps (and timed syncs) per delta case")
    ap.add_argument(
        "--lrs", type=float, nargs="+", default=[1e-4, 1e-6],
        help="learning rates of the delta cases: the default example's, and a 7B full fine-tune's",
    )  # fmt: skip
    ap.add_argument("--no-big", action="store_true", help="delta: leave out the ~0.5B model")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result: dict[str, Any] = {"syncs": args.syncs, "cpus": os.cpu_count(), "engines": 1, "trainer_ranks": 1}
    tmp = tempfile.mkdtemp(prefix="agentrl-bench-ws-")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        for model in args.models if "engine" in args.cases else ():
            t = time.perf_counter()
            path = model_path(model, tmp)
            build_s = time.perf_counter() - t
            result[model] = {"build_s": build_s, **asyncio.run(measure(model, path, args.syncs, args.copies))}
            print(f"{model}: {json.dumps(_rounded(result[model]))}", file=sys.stderr, flush=True)
        if "delta" in args.cases:
            result["delta"] = measure_delta(args.delta_steps, args.lrs, not args.no_big)
        for model in args.models if "lora" in args.cases else ():
            path = model_path(model, tmp)
            result[f"lora_{model}"] = asyncio.run(measure_lora(model, path, args.syncs, args.lora_rank))
            print(f"lora {model}: {json.dumps(_rounded(result[f'lora_{model}']))}", file=sys.stderr, flush=True)
        if "lora" in args.cases:
            result["lora_qwen0.5b_bytes"] = lora_bytes_at_half_a_billion(args.lora_rank)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(_rounded(result), indent=2)
    print(text)
    print(json.dumps(_rounded(result)))


if __name__ == "__main__":
    main()
