"""GPU smoke run: agentrl's trainer paths on one CUDA device in a few minutes, on a node with no network.

It needs only the node's own torch / transformers / safetensors and the wheels `scripts/gpu_node/wheels.txt` lists
(no vLLM, Ray, pydantic or flash-attn there: `scripts/gpu_smoke.sh` installs the carried wheels and agentrl into a
folder of their own). Phases, each printing one JSON line as it ends, so a failing phase keeps what ran before it
(it prints its error, and the next phase still runs):

1. trainer_memory: FSDP2 at world size 1, bf16 mixed precision, activation checkpointing, a random model shaped like
   Qwen2.5-1.5B with its 151,936-token vocabulary: 2 RL steps in the pad layout, the packed layout, and packed with
   CPU offload; peak device memory beside `agentrl plan`'s estimate of the same config.
2. logprob_accuracy: bf16 log-probs against an fp32 reference on the same weights, packed against pad, and the
   shared-prompt pass against the plain one.
3. checkpoint_resume: two RL steps straight through against one step, a DCP save, a reload into a new rank and the
   second step (fused AdamW on CUDA): losses and parameters compared.
4. weight_sync: the NCCL weight-sync group built at world size 1 (one broadcast through it), then the bucketed
   broadcast of the trainer's CUDA tensors to a second process over gloo, checked bit for bit against the bf16
   disk export: plain buckets, then delta buckets (rollout.weight_sync_delta) before and after a few rows move.
5. megatron: Megatron-Core at TP 1 (its local layers unless Transformer Engine is installed) against FSDP2's
   log-probs on the same weights and batch, and 2 steps.

`--cpu --small` runs every phase on CPU in fp32 with small models: tests/test_gpu_smoke_cpu.py runs it so, under an
import hook that refuses every package the node lacks, which is what keeps this script runnable there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 151_936  # Qwen2.5 / Qwen3's
SHAPES = {  # Qwen2 decoders: hidden, intermediate, layers, heads, kv heads
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),  # Qwen/Qwen2.5-1.5B's shape, 1.54B parameters
    "mid": (512, 1536, 4, 8, 2),  # ~92M, most of it the embedding
    "small": (64, 192, 2, 4, 2),  # ~10M: the CPU check
}


@dataclass
class Smoke:
    """What every phase reads: where it runs and the models it builds (each once, random weights, on disk)."""

    cpu: bool
    small: bool
    workdir: Path
    out: Path | None
    models: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    @property
    def precision(self) -> str:
        return "fp32" if self.cpu else "bf16"

    def model(self, shape: str) -> str:
        """A random Qwen2 of `shape` ("small" stands in for every shape on CPU), saved once in bf16."""
        shape = "small" if self.small else shape
        if shape not in self.models:
            self.models[shape] = build_random_qwen2(self.workdir / shape, shape, self.device)
        return self.models[shape]

    def emit(self, line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(text + "\n")


def build_random_qwen2(out: Path, shape: str, device: str) -> str:
    """Random Qwen2 weights from a config (no hub): the shape's decoder and the real vocabulary, tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True, max_position_embeddings=8192,
        pad_token_id=0, eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    return str(out)


def batch(groups: int, per_group: int, prompt: int, completion: int, seed: int = 0) -> list:
    """Groups of rows sharing a random prompt (what the shared-prompt pass runs once), each with its own
    completion of a random length up to `completion` (so pad and packed layouts differ), trained on."""
    from agentrl.types import Sample

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        head = [rng.randrange(3, VOCAB) for _ in range(prompt)]
        for k in range(per_group):
            tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(completion // 2, completion))]
            ids = head + tail
            n = len(ids)
            reward = float(k % 2)
            out.append(Sample(ids, [0] * prompt + [1] * len(tail), [0.0] * n, [0] * n, reward, f"g{g}", f"e{g}.{k}"))
    return out


def sizes(smoke: Smoke) -> dict:
    """Batch and budget of the large phases: ~12K tokens in 2 micro-batches on a GPU."""
    if smoke.small:
        return {"groups": 2, "per_group": 3, "prompt": 48, "completion": 32, "budget": 256}
    return {"groups": 4, "per_group": 4, "prompt": 512, "completion": 256, "budget": 8192}


def trainer_config(smoke: Smoke, *overrides: str, precision: str | None = None):
    """The default config with `overrides`, validated without `load_config`'s env-id check (the env registry
    imports gymnasium, which the node lacks and no trainer needs)."""
    from agentrl.config import Config, apply_override

    s = sizes(smoke)
    raw = Config().model_dump(by_alias=True, mode="python")
    for override in (
        f"trainer.precision={precision or smoke.precision}",
        f"trainer.micro_batch_tokens={s['budget']}",
        f"envs.max_total_tokens={s['budget']}",
        "trainer.optim.lr=1e-5",
        *overrides,
    ):
        apply_override(raw, override)
    return Config.model_validate(raw)


def new_rank(cfg, path: str):
    from agentrl.trainer.worker import TrainerRank
    from agentrl.weightsync.buckets import free_port

    rank = TrainerRank(cfg.model_dump(mode="json", by_alias=True), path, 0, 1)
    rank.setup("127.0.0.1", free_port())
    return rank


@contextlib.contextmanager
def rank_of(cfg, path: str):
    """A trainer rank for the block; shut down (its process group and memory freed) after it."""
    rank = new_rank(cfg, path)
    try:
        yield rank
    finally:
        rank.shutdown()
        del rank
        free_memory()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak(smoke: Smoke) -> None:
    import torch

    if not smoke.cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(smoke: Smoke) -> float | None:
    """Peak device memory since `reset_peak` (None on CPU: a process's peak RSS never comes down to measure the
    next case)."""
    import torch

    if smoke.cpu:
        return None
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def attention_of(model) -> str:
    """The attention implementation the rank's model runs (sdpa, flash_attention_2, agentrl_varlen)."""
    from agentrl.trainer.model import attention_of as attn

    return attn(model)


def on_policy(rank, samples: list) -> list:
    """The batch with the rank's own log-probs as behaviour log-probs (an on-policy batch)."""
    lp = rank.compute_logprobs(samples)
    for i, s in enumerate(samples):
        s.logprobs = lp[i]
    return samples


def diff(a: dict[int, list[float]], b: dict[int, list[float]], samples: list) -> dict:
    """Mean / max |a - b| over the loss tokens (log-probs are 0 elsewhere)."""
    d = [abs(x - y) for i, s in enumerate(samples) for x, y, m in zip(a[i], b[i], s.loss_mask, strict=True) if m]
    return {"mean_abs": float(f"{sum(d) / len(d):.3g}"), "max_abs": float(f"{max(d):.3g}"), "tokens": len(d)}


# ---- phases ------------------------------------------------------------------------------------------------


def trainer_memory(smoke: Smoke) -> list[dict]:
    from agentrl import memory_plan as mp

    path = smoke.model("qwen2.5-1.5b")
    dims = mp.load_dims(path)
    s = sizes(smoke)
    lines = []
    for case, overrides in {
        "pad": ["trainer.packing=pad"],
        "packed": ["trainer.packing=packed"],
        "packed+cpu_offload": ["trainer.packing=packed", "trainer.cpu_offload=true"],
    }.items():
        cfg = trainer_config(smoke, "trainer.activation_checkpointing=true", *overrides)
        samples = batch(s["groups"], s["per_group"], s["prompt"], s["completion"])
        reset_peak(smoke)
        with rank_of(cfg, path) as rank:
            on_policy(rank, samples)
            steps = [rank.train_step(samples) for _ in range(2)]
            attn = attention_of(rank.model)
        plan = mp.trainer_plan(cfg, dims, accelerator=not smoke.cpu, platform=smoke.device)
        lines.append({
            "case": case,
            "attention": attn,
            "params": dims.params,
            "precision": smoke.precision,
            "tokens_per_step": sum(len(x.token_ids) for x in samples),
            "step_s": [round(m["timing/trainer_step"], 3) for m in steps],
            "tokens_per_s": round(steps[-1]["train/tokens_per_s"], 1),
            "loss": [round(m["train/loss"], 6) for m in steps],
            "grad_norm": [round(m["train/grad_norm"], 4) for m in steps],
            "peak_memory_gib": peak_gib(smoke),
            "plan_estimate_gib": round((plan.total - mp.RUNTIME_BYTES) / 2**30, 3),
        })  # fmt: skip
    return lines


def logprob_accuracy(smoke: Smoke) -> list[dict]:
    from agentrl.trainer import prompt_sharing

    path = smoke.model("qwen2.5-1.5b")
    s = sizes(smoke)
    samples = batch(s["groups"], s["per_group"], s["prompt"], s["completion"], seed=1)
    with rank_of(trainer_config(smoke, "trainer.packing=pad", precision="fp32"), path) as rank:
        fp32 = rank.compute_logprobs(samples)
    with rank_of(trainer_config(smoke, "trainer.packing=pad"), path) as rank:
        pad = rank.compute_logprobs(samples)
        shared_ran = rank.backend.shares_prompts(rank.model, grad=False)
        plain_min = prompt_sharing.MIN_SHARED_TOKENS
        prompt_sharing.MIN_SHARED_TOKENS = 10**9  # no prompt worth sharing: every row runs whole
        try:
            plain = rank.compute_logprobs(samples)
        finally:
            prompt_sharing.MIN_SHARED_TOKENS = plain_min
    # On a CUDA node without flash-attn the packed rank runs torch's varlen kernel (agentrl_varlen, chosen by
    # trainer.varlen_attention.choose_attention): packed_vs_pad is then that kernel's check against the pad layout's
    # SDPA, the one the CPU tests can only make with a stand-in.
    with rank_of(trainer_config(smoke, "trainer.packing=packed"), path) as rank:
        packed = rank.compute_logprobs(samples)
        packed_attn = attention_of(rank.model)
    return [{
        "precision": smoke.precision,
        "packed_attention": packed_attn,
        "vs_fp32": diff(pad, fp32, samples),
        "packed_vs_pad": diff(packed, pad, samples),
        "shared_prompts_vs_plain": {**diff(pad, plain, samples), "sharing_ran": shared_ran},
    }]  # fmt: skip


def checkpoint_resume(smoke: Smoke) -> list[dict]:
    import torch

    path = smoke.model("mid")
    s = sizes(smoke)
    first = batch(s["groups"], s["per_group"], s["prompt"] // 4, s["completion"] // 4, seed=2)
    second = batch(s["groups"], s["per_group"], s["prompt"] // 4, s["completion"] // 4, seed=3)
    cfg = trainer_config(smoke)
    ckpt = smoke.workdir / "ckpt"

    def params(rank) -> torch.Tensor:
        return torch.cat([p.detach().full_tensor().flatten().float().cpu() for p in rank.model.parameters()])

    with rank_of(cfg, path) as rank:
        fused = bool(rank.opt.optimizer.defaults.get("fused"))
        rank.train_step(on_policy(rank, first))
        rank.save_checkpoint(str(ckpt))
        straight = rank.train_step(on_policy(rank, second))
        straight_params = params(rank)
    t0 = time.perf_counter()
    with rank_of(cfg, path) as rank:
        version = rank.load_checkpoint(str(ckpt))
        load_s = time.perf_counter() - t0
        resumed = rank.train_step(on_policy(rank, second))
        resumed_params = params(rank)
    return [{
        "fused_adamw": fused,
        "version_restored": version,
        "load_s": round(load_s, 2),
        "loss_straight": straight["train/loss"],
        "loss_resumed": resumed["train/loss"],
        "grad_norm_straight": straight["train/grad_norm"],
        "grad_norm_resumed": resumed["train/grad_norm"],
        "params_max_abs_diff": float((straight_params - resumed_params).abs().max()),
        "params_bitwise_equal": bool(torch.equal(straight_params, resumed_params)),
    }]  # fmt: skip


def weight_sync(smoke: Smoke) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    from agentrl.weightsync.buckets import TensorMeta, free_port, new_group, plan_buckets

    lines = []
    if not smoke.cpu:  # the NCCL group the collective sync builds, at world size 1 (NCCL refuses 2 ranks on 1 GPU)
        t0 = time.perf_counter()
        group = new_group("nccl", "127.0.0.1", free_port(), 0, 1, timeout_s=60)
        probe = torch.arange(1 << 20, dtype=torch.bfloat16, device="cuda")
        group.broadcast(probe, 0).wait()
        torch.cuda.synchronize()
        ok = bool(torch.equal(probe, torch.arange(1 << 20, dtype=torch.bfloat16, device="cuda")))
        group.shutdown()
        lines.append({"case": "nccl_world_size_1", "broadcast_ok": ok, "s": round(time.perf_counter() - t0, 2)})
    path = smoke.model("mid")
    bucket_bytes = 1 << 20 if smoke.small else 16 << 20
    # one receiver process, three syncs: plain buckets; delta buckets after a few rows moved (the group's first delta
    # sync sends whole buckets, so a delta sync runs first to give both ends their copies); delta with nothing moved
    syncs = [("full", False, False), ("delta_first", True, False), ("delta_rows_moved", True, True)]
    where = {"addr": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo", "timeout_s": 120.0}
    with rank_of(trainer_config(smoke), path) as rank:
        metas = rank.weight_metas("bfloat16")
        out = [str(smoke.workdir / f"received-{name}.safetensors") for name, _, _ in syncs]
        spec = json.dumps({"where": where, "metas": metas, "bucket_bytes": bucket_bytes, "out": out,
                           "delta": [delta for _, delta, _ in syncs]})  # fmt: skip
        receiver = subprocess.Popen([sys.executable, __file__, "--receive", spec])
        results = []
        for (name, delta, move), received in zip(syncs, out, strict=True):
            moved = _move_rows(rank) if move else 0
            exported = smoke.workdir / f"exported-{name}"
            rank.export_weights(str(exported), dtype="bfloat16")
            t0 = time.perf_counter()
            sent = rank.broadcast_weights(where, "bfloat16", bucket_bytes, delta)
            results.append((name, received, exported, int(sent or 0), time.perf_counter() - t0, moved))
        if receiver.wait(timeout=300) != 0:
            raise RuntimeError(f"the receiving process exited with {receiver.returncode}")
        device = str(next(rank.model.parameters()).device)
    for name, received, exported, sent, seconds, moved in results:
        got = load_file(received)
        want = {}
        for f in sorted(exported.glob("*.safetensors")):
            want.update(load_file(str(f)))
        mismatched = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
        lines.append({
            "case": f"bucketed_broadcast_over_gloo_{name}",
            "trainer_device": device,
            "tensors": len(metas),
            "buckets_bytes": bucket_bytes,
            "buckets": len(plan_buckets([TensorMeta(n, tuple(shape), dt) for n, shape, dt in metas], bucket_bytes)),
            "elements_moved": moved,
            "bytes_sent": sent,
            "broadcast_s": round(seconds, 3),
            "bitwise_equal_to_bf16_export": not mismatched and set(got) == set(want),
            "mismatched": mismatched[:5],
        })  # fmt: skip
    return lines


def _move_rows(rank) -> int:
    """A few rows of the embedding moved, as a step at a small learning rate moves a few percent of the bf16
    elements; returns the elements moved."""
    import torch

    emb = dict(rank.model.named_parameters())["model.embed_tokens.weight"]
    local = emb.to_local() if hasattr(emb, "to_local") else emb  # FSDP2 at world size 1: the whole tensor
    with torch.no_grad():
        local[:8] += 0.5
    return 8 * local.shape[1]


def receive(spec: str) -> int:
    """The second process of the weight_sync phase: joins the gloo group as rank 1, receives every sync as an
    engine worker does (`agentrl.weightsync.receive.receive_state_dict`, with its copies for delta syncs) and saves
    what each one delivered."""
    import torch
    from safetensors.torch import save_file

    from agentrl.weightsync.buckets import SyncGroup, TensorMeta, new_group
    from agentrl.weightsync.receive import receive_state_dict

    args = json.loads(spec)
    where = SyncGroup(**args["where"])
    group = new_group(where.backend, where.addr, where.port, 1, where.world_size, where.timeout_s)
    metas = [TensorMeta(n, tuple(shape), dtype) for n, shape, dtype in args["metas"]]
    bases: dict = {}
    for out, delta in zip(args["out"], args["delta"], strict=True):
        received = receive_state_dict(group, metas, torch.device("cpu"), args["bucket_bytes"], where.timeout_s,
                                      bases if delta else None)  # fmt: skip
        save_file({n: t.clone() for n, t in received}, out)
    return 0


def megatron(smoke: Smoke) -> list[dict]:
    import importlib.util

    path = smoke.model("mid")
    s = sizes(smoke)
    samples = batch(s["groups"], s["per_group"], s["prompt"] // 4, s["completion"] // 4, seed=4)
    with rank_of(trainer_config(smoke, "trainer.packing=pad"), path) as rank:
        reference = rank.compute_logprobs(samples)
    reset_peak(smoke)
    with rank_of(trainer_config(smoke, "trainer.packing=pad", "trainer.backend=megatron"), path) as rank:
        logprobs = rank.compute_logprobs(samples)
        for i, x in enumerate(samples):
            x.logprobs = logprobs[i]
        steps = [rank.train_step(samples) for _ in range(2)]
        layers = "transformer_engine" if rank.backend.bridge.use_te else "megatron_local"
    return [{
        "layers": layers,
        "precision": smoke.precision,
        "te_installed": importlib.util.find_spec("transformer_engine") is not None,
        "vs_fsdp2": diff(logprobs, reference, samples),
        "step_s": [round(m["timing/trainer_step"], 3) for m in steps],
        "loss": [round(m["train/loss"], 6) for m in steps],
        "grad_norm": [round(m["train/grad_norm"], 4) for m in steps],
        "peak_memory_gib": peak_gib(smoke),
    }]  # fmt: skip


PHASES: dict[str, Callable[[Smoke], list[dict]]] = {
    "trainer_memory": trainer_memory,
    "logprob_accuracy": logprob_accuracy,
    "checkpoint_resume": checkpoint_resume,
    "weight_sync": weight_sync,
    "megatron": megatron,
}


def run_phase(smoke: Smoke, name: str) -> bool:
    """One phase; its lines (or its error) printed as soon as it ends. Returns whether it ran to the end."""
    t0 = time.perf_counter()
    try:
        for line in PHASES[name](smoke):
            smoke.emit({"phase": name, **line, "phase_s": round(time.perf_counter() - t0, 1)})
        return True
    except Exception as e:  # every phase reports, whatever broke the one before
        tail = traceback.format_exc().strip().splitlines()[-6:]
        smoke.emit({"phase": name, "error": f"{type(e).__name__}: {e}"[:500], "traceback": tail,
                    "phase_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
        return False
    finally:
        free_memory()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU in fp32 (checks the script without a GPU)")
    parser.add_argument("--small", action="store_true", help="small models and batches (with --cpu)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of: {', '.join(PHASES)}")
    parser.add_argument("--out", help="also append each JSON line to this file")
    parser.add_argument("--receive", help=argparse.SUPPRESS)  # the weight_sync phase's second process
    args = parser.parse_args()
    if args.receive:
        return receive(args.receive)
    if args.cpu:
        os.environ["AGENTRL_PLATFORM"] = "cpu"
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(unknown)}; known: {', '.join(PHASES)}")
    import torch

    import agentrl
    from agentrl.platform import detect

    plat = detect()
    if not args.cpu and plat.kind != "cuda":
        print(f"gpu_smoke: no CUDA device (platform {plat.kind}); --cpu --small checks the script", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agentrl-smoke-") as tmp:
        smoke = Smoke(args.cpu, args.small or args.cpu, Path(tmp), Path(args.out) if args.out else None)
        smoke.emit({
            "phase": "start", "platform": plat.kind, "torch": torch.__version__, "python": sys.version.split()[0],
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(0), "phases": phases,
            "agentrl": os.path.dirname(agentrl.__file__),
        })  # fmt: skip
        ok = [name for name in phases if run_phase(smoke, name)]
    failed = [p for p in phases if p not in ok]
    smoke.emit({"phase": "end", "ok": ok, "failed": failed, "total_s": round(time.perf_counter() - t0, 1)})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
