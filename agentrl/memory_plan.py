"""Estimated memory of every trainer rank and rollout engine of a run, checked against the device before launch.

A run that cannot fit should fail in one line before any Ray actor starts, not as an out-of-memory error after
minutes of engine start-up. The estimate is a sum of named components (pure functions of the config and the
model's dimensions), so `agentrl plan` can show where the memory goes and say which setting to change.

Assumptions (rough by design; tests/test_memory_plan.py holds it within 0.5x-2x of measured CPU peaks):
- FSDP2 over `trainer.num_ranks`: fp32 master weights, fp32 gradients and AdamW's two fp32 moments are sharded
  (divided by ranks); the unsharded root (embeddings, head) and two decoder layers (current + prefetched) are
  gathered transiently in the compute dtype, with their unsharded gradients before the reduce-scatter.
- Megatron-Core (`trainer.backend: megatron`): a rank holds its TP x PP slice in the compute dtype, fp32 main
  gradients, and fp32 main params (bf16) + AdamW moments, sharded over data-parallel replicas only with the
  distributed optimizer; its vocab-parallel log-probs hold the whole micro-batch's logit slice in fp32.
- Activations of one micro-batch of `max(trainer.micro_batch_tokens, envs.max_total_tokens)` tokens (a sample
  longer than the budget gets a micro-batch of its own), memory-efficient attention (no T x T scores); a packed
  micro-batch under SDPA also holds its T x T bool block mask, counted where the trainer's attention
  (`varlen_attention.choose_attention`, the same decision the ranks make) is SDPA: on CPU, in fp32, or on CUDA
  with neither flash-attn nor torch's varlen kernel (flash-attention and the varlen kernel need none), and under
  Megatron-Core, whose micro-batches the worker collates with it. With
  activation checkpointing: every layer's input plus one layer's activations (recomputed in backward); without:
  every layer's activations.
- Log-prob/entropy logits as the trainer computes them: the head's output over every token of the micro-batch (the
  loss may need fewer) and its gradient, in the compute dtype, plus fp32 softmax temporaries for one chunk of
  `LOGIT_CHUNK_ELEMS` logits at a time (agentrl.trainer.losses).
- A reference model (compute dtype, sharded, no gradients) when `algorithm.kl_coef > 0`; a critic (backbone + value
  head, with its own gradients and AdamW) when `algorithm.advantage == "gae"`.
- Engines: weights in the engine dtype (bf16 on accelerators, fp32 on CPU), with rollout.weight_sync_delta a copy of
  them in host memory (counted on CPU, where host memory is the device), and the KV cache: vLLM claims
  `rollout.gpu_memory_utilization` of the device (weights included) on accelerators, `rollout.kv_cache_gib`
  on CPU. Each trainer rank and engine has a device of its own on accelerators; on CPU they all share host RAM.
- A fixed allowance per process for the runtime (CUDA context / allocator slack, or Python + torch on CPU).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.config import Config, ConfigError
from agentrl.trainer.losses import LOGIT_CHUNK_ELEMS
from agentrl.trainer.varlen_attention import choose_attention, reads_packed_boundaries

GiB = 1024**3
RUNTIME_BYTES = 1 * GiB  # per trainer rank / engine process: CUDA context + allocator slack, or Python + torch
DEVICE_MEMORY_ENV = "AGENTRL_DEVICE_MEMORY"  # e.g. 80GiB: overrides the detected device (or host) memory


@dataclass(frozen=True)
class ModelDims:
    """What the estimate needs from a model's config.json."""

    name: str
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False  # Qwen2 / Qwen2.5
    qk_norm: bool = False  # Qwen3
    source: str = "config.json"

    @property
    def layer_params(self) -> int:
        """One decoder layer: q/k/v/o projections (+ qkv bias, + q/k norms), SwiGLU MLP, two RMSNorms."""
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        extra = (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return h * q + 2 * h * kv + q * h + extra + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and (untied) LM head: FSDP2's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """LoRA adapters of `rank` on the decoder layers' `targets` (A: rank x in, B: out x rank per linear)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                  "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
        return self.layers * sum(rank * (a + b) for name, (a, b) in shapes.items() if name in targets)


def dims_from_config(cfg: dict, name: str, source: str = "config.json") -> ModelDims:
    """ModelDims from a Hugging Face config.json dict (Llama/Qwen-style decoder)."""
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the language model's config inside
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelDims(
        name=name,
        hidden=hidden,
        layers=int(cfg["num_hidden_layers"]),
        vocab=int(cfg["vocab_size"]),
        intermediate=int(cfg["intermediate_size"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        qk_norm=cfg.get("model_type") == "qwen3",
        source=source,
    )


# Published config.json values of a few well-known hub models, so that `agentrl plan` works offline.
# name: (hidden, layers, vocab, intermediate, heads, kv_heads, head_dim, tied)
KNOWN_DIMS: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    "Qwen/Qwen2.5-0.5B": (896, 24, 151936, 4864, 14, 2, 64, True),
    "Qwen/Qwen2.5-1.5B": (1536, 28, 151936, 8960, 12, 2, 128, True),
    "Qwen/Qwen2.5-3B": (2048, 36, 151936, 11008, 16, 2, 128, True),
    "Qwen/Qwen2.5-7B": (3584, 28, 152064, 18944, 28, 4, 128, False),
    "Qwen/Qwen3-0.6B": (1024, 28, 151936, 3072, 16, 8, 128, True),
    "Qwen/Qwen3-1.7B": (2048, 28, 151936, 6144, 16, 8, 128, True),
    "Qwen/Qwen3-4B": (2560, 36, 151936, 9728, 32, 8, 128, True),
    "Qwen/Qwen3-8B": (4096, 36, 151936, 12288, 32, 8, 128, False),
}


def _known(name: str, source: str) -> ModelDims:
    h, n, v, i, a, kv, d, tied = KNOWN_DIMS[name]
    qwen3 = name.startswith("Qwen/Qwen3")
    return ModelDims(name, h, n, v, i, a, kv, d, tied, qkv_bias=not qwen3, qk_norm=qwen3, source=source)


def known_dims(model_id: str) -> ModelDims | None:
    """Built-in dims of a well-known hub id (an -Instruct / -Base variant has its base model's shape)."""
    base = re.sub(r"-(Instruct|Base|Chat)$", "", model_id.rstrip("/"), flags=re.IGNORECASE)
    for name in KNOWN_DIMS:
        if name.lower() == base.lower():
            dims = _known(name, f"built-in dims of {name}, from its published config.json")
            return ModelDims(**{**dims.__dict__, "name": model_id})
    return None


def parse_count(text: str) -> int:
    """'7B', '500M', '1.5e9' -> a parameter count."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMBT]?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"--params: cannot read {text!r} (e.g. 7B, 500M)")
    scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def parse_bytes(text: str) -> int:
    """'80GiB', '80G', '512MiB', '1.5TB' -> bytes (G and GB are read as GiB: device memory is quoted so)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"memory size: cannot read {text!r} (e.g. 80GiB, 512MiB)")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))


def dims_for_params(count: int) -> ModelDims:
    """--params: the built-in shape with the nearest parameter count, labelled as such."""
    name = min(KNOWN_DIMS, key=lambda n: abs(_known(n, "").params - count))
    return _known(name, f"--params {count / 1e9:.2g}B: shape of {name}, the nearest built-in model")


def plan_model_path(cfg: Config) -> str:
    """The model the plan reads, never downloaded: `builtin:` models are built, a hub id stays one (`load_dims`
    reads its cached config.json or known dims), a local folder is itself."""
    from agentrl.models.hub import is_hub_id
    from agentrl.models.tiny import resolve_model_path

    path = cfg.model.path
    return path if is_hub_id(path) else resolve_model_path(path, cfg.model.cache_dir, cfg.model.revision)


def load_dims(path: str, params: str | None = None) -> ModelDims:
    """The model's dims without downloading: a local dir's config.json, a hub id's cached config.json, built-in
    dims of a well-known hub id, or the shape nearest to `params`. ConfigError (one line) when none applies."""
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return dims_from_config(json.loads(local.read_text()), path)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # not a valid repo id
        cached = None
    if isinstance(cached, str):
        return dims_from_config(json.loads(Path(cached).read_text()), path, "cached config.json")
    found = known_dims(path)
    if found is not None:
        return found
    if params is not None:
        return dims_for_params(parse_count(params))
    raise ConfigError(
        f"model.path: no config.json for {path!r} offline (not a local dir, not in the hub cache, no built-in dims);"
        " pass --params 7B-style or a local model dir"
    )


# ---- device memory ---------------------------------------------------------------------------------------------


def host_memory() -> int:
    """Physical RAM, or the cgroup's memory limit when lower (containers)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def device_memory(kind: str) -> tuple[int, str]:
    """Memory of one device of this platform (device 0), or host RAM on CPU; AGENTRL_DEVICE_MEMORY overrides."""
    forced = os.environ.get(DEVICE_MEMORY_ENV)
    if forced:
        return parse_bytes(forced), DEVICE_MEMORY_ENV
    if kind == "cpu":
        return host_memory(), "host RAM"
    if kind == "cuda":
        found = _nvml_memory()
        if found is not None:
            return found
    import torch  # a device context on device 0 in this process (~0.5 GiB there): NVML first, where it exists

    props = torch.cuda.get_device_properties(0) if kind == "cuda" else torch.npu.get_device_properties(0)
    return int(props.total_memory), f"{kind}:0 {props.name}"


def _nvml_memory() -> tuple[int, str] | None:
    """Device 0's memory from NVML (nvidia-ml-py), which opens no CUDA context: the driver that plans a run must
    not take memory on the device trainer rank 0 then uses. None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            handle = (
                pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-"))
                else pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
            )  # fmt: skip
            name = pynvml.nvmlDeviceGetName(handle)
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return total, f"cuda:0 {name.decode() if isinstance(name, bytes) else name}"


# ---- the estimate ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    how: str = ""


@dataclass
class ActorPlan:
    """One trainer rank or one engine: its components, and how many such actors the run starts."""

    role: str
    count: int
    components: list[Component]

    @property
    def total(self) -> float:
        return sum(c.bytes for c in self.components)


@dataclass
class MemoryPlan:
    dims: ModelDims
    platform: str  # cpu | cuda | npu
    device_bytes: int
    device_source: str
    settings: dict[str, str]
    trainer: ActorPlan
    engine: ActorPlan | None  # None: engines are not ours (rollout.backend=remote)
    problems: list[str] = field(default_factory=list)

    @property
    def shared_host(self) -> bool:
        return self.platform == "cpu"

    @property
    def host_total(self) -> float:
        """CPU: every rank and engine shares host RAM."""
        engines = self.engine.total * self.engine.count if self.engine else 0.0
        return self.trainer.total * self.trainer.count + engines


def count(n: float) -> str:
    """476k, 494M, 7.6B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def micro_batch_tokens(cfg: Config) -> int:
    """Tokens in the largest micro-batch: the budget, or one sample at the episode length cap."""
    return max(cfg.trainer.micro_batch_tokens, cfg.envs.max_total_tokens)


def layer_activation_elems(d: ModelDims, tp: int = 1) -> int:
    """Tensors one decoder layer keeps for backward, per token: the two RMSNorms (input, normalised, scaled),
    q/k norms and rotary embedding, the GQA-expanded k/v, the attention output, and the SwiGLU MLP's gate, up,
    activation and product. Tensor parallelism splits the attention heads and the MLP's width over `tp` ranks
    (the hidden-size tensors stay whole without sequence parallelism)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return 6 * d.hidden + (9 * q + 5 * kv + 4 * d.intermediate) // tp


def resolved_precision(cfg: Config, accelerator: bool) -> tuple[str, bool]:
    """(compute dtype, activation checkpointing) after `auto` / None are resolved for the platform."""
    tc = cfg.trainer
    precision = tc.precision if tc.precision != "auto" else ("bf16" if accelerator else "fp32")
    ckpt = tc.activation_checkpointing if tc.activation_checkpointing is not None else accelerator
    return precision, ckpt


def trainer_plan(cfg: Config, d: ModelDims, accelerator: bool, platform: str | None = None) -> ActorPlan:
    """One trainer rank's peak: its states (as `trainer.backend` splits them) + one micro-batch's activations and
    logits. `platform` (cpu / cuda / npu): where the ranks run (default: cuda for an accelerator)."""
    tc = cfg.trainer
    platform = platform or ("cuda" if accelerator else "cpu")
    precision, ckpt = resolved_precision(cfg, accelerator)
    a = 2 if precision == "bf16" else 4
    T = micro_batch_tokens(cfg)
    megatron = tc.backend == "megatron"
    comps = _megatron_states(cfg, d, a, precision) if megatron else _fsdp2_states(cfg, d, a, precision, accelerator)
    tp = tc.megatron.tensor_parallel if megatron else 1
    per_layer = layer_activation_elems(d, tp) * T * a
    if ckpt:
        act = d.layers * d.hidden * T * a + per_layer
        how = f"checkpointed: {d.layers} layer inputs + 1 layer, {T} tokens, {precision}"
    else:
        act = d.layers * per_layer
        how = f"all {d.layers} layers, {T} tokens, {precision}"
    if megatron and tp > 1:
        how += f", attention and MLP split over TP {tp}"
    comps.append(Component("activations", act, how))
    if megatron:  # vocab-parallel log-probs: the whole micro-batch's logit slice at once, in fp32 (not chunked)
        v = -(-d.vocab // tp)
        comps.append(Component(
            "logits", T * v * (2 * a + 16),
            f"{T} tokens x {v} vocab (TP slice): head output + gradient ({precision}), fp32 copy, its clone and"
            " softmax / entropy temporaries, unchunked",
        ))  # fmt: skip
    else:
        rows = min(T, max(1, LOGIT_CHUNK_ELEMS // d.vocab))
        comps.append(Component(
            "logits", T * d.vocab * 2 * a + rows * d.vocab * 12,
            f"{T} tokens x {d.vocab} vocab: head output + gradient ({precision}), fp32 softmax {rows} rows at a time",
        ))  # fmt: skip
    if tc.packing == "packed":  # the worker collates it unless the model reads the boundaries from the positions
        attn = "megatron" if megatron else choose_attention(platform, precision == "bf16")
        if megatron or not reads_packed_boundaries(attn):
            comps.append(Component("packed mask", T * T, f"bool {T} x {T} block mask ({attn} attention)"))
    runtime = "device context + allocator slack" if accelerator else "Python + torch + transformers"
    comps.append(Component("runtime", RUNTIME_BYTES, runtime))
    return ActorPlan("trainer rank", tc.num_ranks, comps)


def _fsdp2_states(cfg: Config, d: ModelDims, a: int, precision: str, accelerator: bool) -> list[Component]:
    """FSDP2: fp32 master weights, gradients and AdamW moments sharded over every rank, plus the transient
    all-gathers (root + two layers in the compute dtype, with their unsharded gradients)."""
    tc, alg = cfg.trainer, cfg.trainer.algorithm
    ranks, P = tc.num_ranks, d.params
    offload = tc.cpu_offload and accelerator
    where = " (in host memory: cpu_offload)" if offload else ""
    states = 0.0 if offload else 1.0
    # with LoRA only the adapters (L params) have gradients and optimizer state; the base is frozen, except in a
    # full warm start (trainer.lora.warm_start), which fine-tunes the plain model first: its peak is full FT's
    full_sft = tc.lora is not None and tc.sft.enabled and tc.lora.warm_start == "full"
    lora = tc.lora is not None and not full_sft
    L = d.lora_params(tc.lora.rank, tc.lora.target_modules) if lora else 0
    trained, total = (L, P + L) if lora else (P, P)
    of = f", the {count(L)} LoRA adapter params" if lora else " (the full warm start's)" if full_sft else ""
    grads = "" if lora else " + their fp32 grads before reduce-scatter"
    comps = [
        Component("weights", states * 4 * total / ranks, f"fp32 master, {count(total)} params / {ranks} ranks{where}"),
        Component("gradients", states * 4 * trained / ranks, f"fp32, sharded{where}{of}"),
        Component("optimizer", states * 8 * trained / ranks, f"AdamW m + v fp32, sharded{where}{of}"),
        Component(
            "gathered params",
            (d.root_params + 2 * d.layer_params) * (a + (0 if lora else 4)),
            f"root + 2 layers unsharded ({precision}){grads}",
        ),
    ]
    if alg.kl_coef > 0:
        comps.append(
            Component("reference model", states * a * P / ranks, f"kl_coef > 0: {precision}, sharded, no grads{where}")
        )
    if alg.advantage == "gae":
        critic = P - (0 if d.tied else d.vocab * d.hidden) + d.hidden
        comps.append(Component("critic", states * 16 * critic / ranks, f"gae: weights + grads + AdamW, sharded{where}"))
    return comps


def _megatron_states(cfg: Config, d: ModelDims, a: int, precision: str) -> list[Component]:
    """Megatron-Core: each rank holds its tensor x pipeline slice of the model in the compute dtype, fp32 main
    gradients (`grad_reduce_in_fp32`), and the optimizer's fp32 main params (bf16 only) and AdamW moments, those
    sharded over the data-parallel replicas with `megatron.distributed_optimizer` (else replicated)."""
    tc, m, alg = cfg.trainer, cfg.trainer.megatron, cfg.trainer.algorithm
    mp_size = m.tensor_parallel * m.pipeline_parallel
    dp = max(tc.num_ranks // max(m.model_parallel, 1), 1)
    P = d.params / mp_size
    split = f"{count(d.params)} params / TP {m.tensor_parallel} x PP {m.pipeline_parallel}"
    opt_bytes = (4 if precision == "bf16" else 0) + 8
    opt_share = dp if m.distributed_optimizer else 1
    opt_how = "fp32 main params + AdamW m + v" if precision == "bf16" else "AdamW m + v fp32"
    opt_how += f", sharded over DP {dp}" if m.distributed_optimizer else ", replicated (distributed_optimizer off)"
    comps = [
        Component("weights", a * P, f"{precision} model params, {split}"),
        Component("gradients", 4 * P, "fp32 main grads (grad_reduce_in_fp32)"),
        Component("optimizer", opt_bytes * P / opt_share, opt_how),
    ]
    if alg.kl_coef > 0:
        comps.append(Component("reference model", a * P, f"kl_coef > 0: {precision}, {split}, no grads"))
    if alg.advantage == "gae":
        critic = (d.params - (0 if d.tied else d.vocab * d.hidden) + d.hidden) / mp_size
        comps.append(Component("critic", (a + 4 + opt_bytes / opt_share) * critic, "gae: as the policy"))
    return comps


def engine_plan(cfg: Config, d: ModelDims, accelerator: bool, device_bytes: int) -> ActorPlan | None:
    """One rollout engine: weights in the engine dtype, the KV cache, the runtime."""
    ro = cfg.rollout
    if ro.backend == "remote":
        return None
    e = 2 if accelerator else 4
    weight_bytes = d.params * e
    weights = Component("weights", weight_bytes, f"{count(d.params)} params, {'bf16' if accelerator else 'fp32'}")
    runtime = Component(
        "runtime", RUNTIME_BYTES, "activations, graphs, device context" if accelerator else "Python + torch + vLLM"
    )
    if accelerator:
        kv_bytes = max(ro.gpu_memory_utilization * device_bytes - weight_bytes - RUNTIME_BYTES, 0.0)
        seqs = kv_bytes / (d.kv_bytes_per_token(e) * ro.max_model_len)
        kv = Component(
            "KV cache",
            kv_bytes,
            f"the rest of gpu_memory_utilization {ro.gpu_memory_utilization} x device: ~{seqs:.0f} sequences of"
            f" {ro.max_model_len} tokens",
        )
    else:
        kv = Component("KV cache", ro.kv_cache_gib * GiB, f"rollout.kv_cache_gib={ro.kv_cache_gib}")
    components = [weights, kv, runtime]
    if ro.weight_sync_delta and not accelerator:  # on accelerators it is host memory, not the device's
        components.append(Component("delta-sync copy", weight_bytes, "the weights last synced (host memory)"))
    return ActorPlan("rollout engine", ro.num_engines, components)


def make_plan(
    cfg: Config,
    d: ModelDims,
    platform: str,
    device_bytes: int,
    device_source: str = "",
) -> MemoryPlan:
    accelerator = platform != "cpu"
    precision, ckpt = resolved_precision(cfg, accelerator)
    settings = {
        "precision": precision,
        "activation checkpointing": "on" if ckpt else "off",
        "micro-batch tokens": str(micro_batch_tokens(cfg)),
    }
    plan = MemoryPlan(
        d,
        platform,
        device_bytes,
        device_source,
        settings,
        trainer_plan(cfg, d, accelerator, platform),
        engine_plan(cfg, d, accelerator, device_bytes),
    )
    plan.problems = _problems(plan, cfg)
    return plan


# ---- verdict ---------------------------------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _fits(cfg: Config, plan: MemoryPlan) -> bool:
    """Whether the trainer side of `cfg` fits (what-if checks of the remedies)."""
    accelerator = plan.platform != "cpu"
    t = trainer_plan(cfg, plan.dims, accelerator, plan.platform)
    if not accelerator:
        engines = plan.engine.total * plan.engine.count if plan.engine else 0.0
        return t.total * t.count + engines <= plan.device_bytes
    return t.total <= plan.device_bytes


def _trainer_remedies(plan: MemoryPlan, cfg: Config) -> list[str]:
    """Settings that would make the trainer fit, each checked by re-planning with it alone changed."""
    tc, accelerator = cfg.trainer, plan.platform != "cpu"
    out = []
    if not resolved_precision(cfg, accelerator)[1]:
        out.append("set trainer.activation_checkpointing=true")
    if accelerator:  # on CPU the ranks share the host: more ranks never help
        whole = tc.megatron.model_parallel if tc.backend == "megatron" else 1  # replicas of the model-parallel group
        for ranks in (r for r in (2, 4, 6, *range(8, 257, 8)) if r > tc.num_ranks and r % whole == 0):
            alt = cfg.model_copy(deep=True)
            alt.trainer.num_ranks = ranks
            if _fits(alt, plan):
                out.append(f"raise trainer.num_ranks to {ranks}")
                break
    tokens = tc.micro_batch_tokens // 2
    while tokens >= 256:
        alt = cfg.model_copy(deep=True)
        alt.trainer.micro_batch_tokens = tokens
        alt.envs.max_total_tokens = min(cfg.envs.max_total_tokens, tokens)
        if _fits(alt, plan):
            capped = " (and envs.max_total_tokens)" if tokens < cfg.envs.max_total_tokens else ""
            out.append(f"lower trainer.micro_batch_tokens to {tokens}{capped}")
            break
        tokens //= 2
    if accelerator and not tc.cpu_offload:
        out.append("trainer.cpu_offload=true")
    if not accelerator:
        if tc.num_ranks > 1:
            out.append("lower trainer.num_ranks (ranks share the host)")
        if plan.engine is not None:
            out.append("lower rollout.kv_cache_gib or rollout.num_engines")
    if len(out) > 1:
        out[-1] = "or " + out[-1]
    return out


def _problems(plan: MemoryPlan, cfg: Config) -> list[str]:
    """One line per thing that does not fit, naming the settings that would make it fit."""
    out, mem = [], plan.device_bytes
    if plan.shared_host:
        if plan.host_total > mem:
            what = f"{plan.trainer.count} trainer rank(s)" + (
                f" and {plan.engine.count} engine(s)" if plan.engine else ""
            )
            fixes = ", ".join(_trainer_remedies(plan, cfg)) or "use a machine with more memory"
            out.append(f"{what} need {_gib(plan.host_total)} of {_gib(mem)} host RAM: {fixes}")
        return out
    if plan.trainer.total > mem:
        fixes = ", ".join(_trainer_remedies(plan, cfg)) or "use a device with more memory"
        out.append(f"trainer rank needs {_gib(plan.trainer.total)} of {_gib(mem)}: {fixes}")
    if plan.engine is not None:
        ro, kv = cfg.rollout, plan.engine.components[1].bytes
        need = plan.dims.kv_bytes_per_token(2) * ro.max_model_len
        if kv < need:
            out.append(
                f"rollout engine: weights leave {_gib(kv)} of rollout.gpu_memory_utilization="
                f"{ro.gpu_memory_utilization} x {_gib(mem)} for the KV cache, one {ro.max_model_len}-token sequence"
                f" needs {_gib(need)}: raise rollout.gpu_memory_utilization or lower rollout.max_model_len"
            )
    return out


def check_memory_plan(cfg: Config, model_path: str) -> None:
    """Refuse (ConfigError, one line) a run whose plan cannot fit. Needs no Ray: `agentrl train` calls it before
    any actor starts. Not checked: a hub model whose dims are not known offline (the run will fetch it), and a
    driver whose run's devices are elsewhere (a CPU driver joining a cluster, or `platform` naming devices this
    node lacks), unless AGENTRL_DEVICE_MEMORY gives their size. AGENTRL_DEVICE_MEMORY=off skips the check."""
    forced = os.environ.get(DEVICE_MEMORY_ENV, "").lower()
    if forced in ("off", "0", "none"):
        return
    try:
        dims = load_dims(model_path)
    except ConfigError:
        return
    from agentrl.platform import detect

    here = detect().kind
    kind = here if cfg.platform == "auto" else cfg.platform
    if kind != here or (kind == "cpu" and cfg.ray_address is not None):  # the run's devices are on other nodes
        if not forced:
            return
        kind = "cuda" if kind == "cpu" else kind  # the cluster's devices, whose size AGENTRL_DEVICE_MEMORY gives
    mem, source = device_memory(kind)
    plan = make_plan(cfg, dims, kind, mem, source)
    if plan.problems:
        raise ConfigError(f"memory plan: {plan.problems[0]} (see agentrl plan)")
