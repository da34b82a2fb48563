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
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
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

    from agentrl.trainer.weight_sync import stream_weights, weight_metas

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
    from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES

    t0 = time.perf_counter()
    plan = await router.weight_sync_members.remote()
    dtype = plan["dtype"] or "float32"
    members = await router.hold.remote(plan["members"], sync.drain)
    assert members == sync._members, "the engine set changed: the probe would need a new group"
    source = {"group": asdict(sync._group), "metas": sync._metas, "bucket_bytes": DEFAULT_BUCKET_BYTES}
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
    from agentrl.rollout.fleet import engine_kwargs, engine_options, start_router
    from agentrl.run.weights import WeightSync
    from agentrl.trainer import TrainerGroup
    from agentrl.weight_buckets import DEFAULT_BUCKET_BYTES

    out: dict[str, Any] = {"model_path": path}
    rcfg = RolloutConfig(num_engines=1)
    t0 = time.perf_counter()
    options, kwargs = engine_options(rcfg, CPU, None, 0), engine_kwargs(rcfg, path, 0)
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


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


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
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result: dict[str, Any] = {"syncs": args.syncs, "cpus": os.cpu_count(), "engines": 1, "trainer_ranks": 1}
    tmp = tempfile.mkdtemp(prefix="agentrl-bench-ws-")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        for model in args.models:
            t = time.perf_counter()
            path = model_path(model, tmp)
            build_s = time.perf_counter() - t
            result[model] = {"build_s": build_s, **asyncio.run(measure(model, path, args.syncs, args.copies))}
            print(f"{model}: {json.dumps(_rounded(result[model]))}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(_rounded(result), indent=2)
    print(text)
    print(json.dumps(_rounded(result)))


if __name__ == "__main__":
    main()
