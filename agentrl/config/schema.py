"""The one typed config of agentrl: every section of a run's YAML, validated, with defaults that run on CPU.

Models forbid unknown keys. Free-form sections are typed `dict[str, ...]` (env kwargs, engine kwargs, env
tags, tool sets): only there may the command line add keys with `+key=value`.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

# Keys renamed since, and where they went: a config that still uses one gets this one line ("turn" is the env's and
# the model's word, "step" the trainer's).
MOVED_KEYS = {
    "envs.max_tokens_per_turn": "rollout.sampling.max_tokens (new tokens per model turn)",
    "envs.step_timeout_s": "envs.call_timeout_s",
    "envs.step_history_window": "envs.turn_history_window",
}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class ModelConfig(Section):
    """The policy model: its weights, tokenizer and where built-in models are built."""

    path: str = Field("builtin:tiny", description="HF model dir, hub id, or builtin:NAME (built on first use)")
    tokenizer: str | None = Field(None, description="tokenizer path; defaults to the model path")
    cache_dir: str = Field("~/.cache/agentrl/models", description="where builtin models are built")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) when path is a hub id")


class EnvConfig(Section):
    """An env as validation runs it: single episodes on held-out task seeds."""

    env_id: str = Field(..., description="registered env id, e.g. agentrl/SimpleSokoban-v0")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="env constructor kwargs (free keys)")
    max_turns: PositiveInt | None = Field(
        None, description="model turns per episode, tool-call turns included; default: the env's own max_steps"
    )
    seed_start: int = Field(0, description="first task seed; validation uses disjoint seeds")
    tools: list[str] = Field(default_factory=list, description="tool sets this env may call")
    agent: str | None = Field(
        None,
        description="an agent program (module:function or a registered name) that plays this env through the "
        "OpenAI-compatible gateway instead of the env manager's own loop (verifiers/... envs: verifiers' own)",
    )

    @model_validator(mode="after")
    def _verifiers_play_their_own(self) -> EnvConfig:
        """A verifiers env drives the model itself: its agent is verifiers' rollout, through the gateway."""
        if self.env_id.startswith("verifiers/") and self.agent is None:
            self.agent = "agentrl.envs.verifiers_env:verifiers_agent"
        return self


class TrainEnvConfig(EnvConfig):
    """An env as training runs it: groups of episodes per task seed."""

    group_size: PositiveInt = Field(8, description="episodes per task seed (GRPO group)")
    groups_per_batch: PositiveInt = Field(4, description="groups of this tag in one training batch")
    self_play: bool = Field(
        False,
        description="both seats of a two-player env played by the policy (TextArena games): each of the "
        "group_size games is two episodes, one per seat, each seat's turns its own samples with its own reward, "
        "and advantages computed within each seat's episodes (a per-role baseline)",
    )


class EnvsConfig(Section):
    """The envs the run trains and validates on, and how their episodes become samples."""

    train: dict[str, TrainEnvConfig] = Field(
        default_factory=lambda: {"sokoban": TrainEnvConfig(env_id="agentrl/SimpleSokoban-v0")}
    )
    val: dict[str, EnvConfig] = Field(default_factory=dict)
    sample_mode: Literal["trajectory", "turn"] = Field(
        "trajectory",
        description="trajectory: one sample per episode (the whole token history); turn: one sample per model turn "
        "(its prompt is the system prompt and the last turn_history_window turns)",
    )
    turn_history_window: int = Field(0, ge=0, description="turn-wise samples: past turns kept in the prompt")
    max_total_tokens: PositiveInt = Field(4096, description="episode length cap (prompt + every turn)")
    num_managers: PositiveInt = Field(1, description="env-manager actors; episodes are spread over them")
    call_timeout_s: PositiveFloat = Field(
        30.0,
        description="limit on every env call (build, reset, step, the expert) in every phase; past it the episode "
        "fails",
    )
    env_threads: PositiveInt = Field(16, description="threads per env manager for env.reset/step (blocking code)")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Keys and values renamed since: one line naming the new one ("turn" is the env's and the model's word,
        "step" the trainer's)."""
        if not isinstance(data, dict):
            return data
        for old, new in MOVED_KEYS.items():
            if old.startswith("envs.") and old.removeprefix("envs.") in data:
                raise ValueError(f"{old.removeprefix('envs.')} moved to {new}")
        if data.get("sample_mode") == "step":
            raise ValueError("sample_mode: step is now sample_mode: turn (one sample per model turn)")
        return data

    @model_validator(mode="after")
    def _has_train_envs(self) -> EnvsConfig:
        if not self.train:  # a run without train envs has nothing to sample: fail here, not mid-run
            raise ValueError("train is empty; a run needs at least one training env (envs.train.TAG.env_id)")
        return self


class ToolSpec(Section):
    """One tool: in process (`python`) or on a tool server (`url`)."""

    python: str | None = Field(None, description="module:function for an in-process tool")
    url: str | None = Field(None, description="tool server base URL for a remote tool")
    timeout_s: PositiveFloat = Field(10.0, description="limit on one call; past it the model reads an error")
    token_env: str | None = Field(None, description="environment variable holding the bearer token")

    @model_validator(mode="after")
    def _one_location(self) -> ToolSpec:
        if (self.python is None) == (self.url is None):
            raise ValueError("a tool needs exactly one of `python` (module:function) or `url`")
        return self


class ToolsConfig(Section):
    """Tool sets the envs may call (`envs.*.<tag>.tools`), and limits on calls."""

    sets: dict[str, dict[str, ToolSpec]] = Field(default_factory=dict, description="tool set -> name -> tool")
    parser: str = Field("hermes", description="tool-call parser name")
    max_calls_per_turn: PositiveInt = Field(
        4, description="tool calls run per model turn; more are answered with an error"
    )
    max_calls_per_episode: PositiveInt = Field(
        32, description="tool calls run per episode; more are answered with an error"
    )


class RewardFnSpec(Section):
    """One reward function, added to the env's return with its weight."""

    name: str = Field(..., description="registered reward name or module:function")
    weight: float = Field(1.0, description="its weight in the return")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments passed to the function")
    timeout_s: PositiveFloat = Field(30.0, description="limit on one call; past it the episode gets no sample")
    label: str | None = Field(None, description="component name (default: name); needed to use a function twice")
    isolation: Literal["none", "process"] = Field(
        "none", description="process: run in a subprocess that is killed on timeout (CPU-heavy / unsafe verifiers)"
    )

    @property
    def key(self) -> str:
        return self.label or self.name


class RewardConfig(Section):
    """Reward functions scored by async reward workers on top of the env's return."""

    functions: list[RewardFnSpec] = Field(default_factory=list, description="reward functions (name, weight, ...)")
    env_reward_weight: float = Field(1.0, description="return = env_reward_weight * env return + sum(w_i r_i)")
    num_workers: PositiveInt = Field(1, description="reward worker actors")
    queue_size: PositiveInt = Field(1024, description="episodes queued or in flight before score() waits")
    timeout_s: PositiveFloat = Field(60.0, description="whole-episode limit, on top of each function's timeout_s")
    process_slots: PositiveInt = Field(2, description="subprocesses per worker for isolation=process functions")

    @model_validator(mode="after")
    def _unique_keys(self) -> RewardConfig:
        keys = [f.key for f in self.functions]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"reward.functions: duplicate component names {dup}; give them distinct `label`s")
        return self


class SamplingConfig(Section):
    """Sampling of one model turn; engines take it as is."""

    temperature: float = Field(1.0, ge=0.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 disables it")
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k")
    max_tokens: PositiveInt = Field(64, description="new tokens per model turn")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a turn, besides EOS")
    seed: int | None = Field(
        None, description="a seed per request; None: the engine's own generator (seeded by the run's seed)"
    )
    ignore_eos: bool = Field(False, description="generate exactly max_tokens (benchmarks)")


class ValSamplingConfig(Section):
    """Validation's changes to `rollout.sampling`: unset fields (None) keep the training value."""

    temperature: float | None = Field(0.0, ge=0.0, description="greedy by default")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="None: the training value")
    top_k: int | None = Field(None, ge=-1, description="None: the training value")
    max_tokens: PositiveInt | None = Field(None, description="None: the training value")
    stop_token_ids: list[int] | None = Field(None, description="None: the training value")
    seed: int | None = Field(None, description="None: the training value")


class RolloutConfig(Section):
    """The rollout engines: backend, count, sampling, health and how weights reach them."""

    backend: Literal["vllm", "sglang", "remote"] = Field(
        "vllm", description="vllm / sglang: engines in Ray actors; remote: a running server at `url`"
    )
    num_engines: PositiveInt = Field(1, description="rollout engine actors")
    url: str | None = Field(None, description="base URL of a running server (backend=remote)")
    max_model_len: PositiveInt = Field(4096, description="the engines' context length")
    enforce_eager: bool | None = Field(None, description="None: eager on CPU, CUDA/NPU graphs on accelerators")
    kv_cache_gib: PositiveFloat = Field(
        1.0, description="CPU KV cache size in GiB (the tiny model takes ~1 KiB a token); zero-filled at engine start"
    )
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0, description="share of device memory an engine takes")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra engine args (free keys)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling of training episodes")
    val_sampling: ValSamplingConfig = Field(
        default_factory=ValSamplingConfig, description="validation's changes to `sampling` (greedy by default)"
    )
    request_timeout_s: PositiveFloat = Field(300.0, description="limit on one model turn at the engines")
    restart_engines: int = Field(2, ge=0, description="restarts of each dead engine before giving it up; 0 = never")
    no_engine_timeout_s: PositiveFloat = Field(
        60.0, description="stop the run (leaving a checkpoint) when no engine has been healthy this long"
    )
    stop_after_failed_groups: PositiveInt = Field(
        8, description="stop the run when every episode of this many consecutive groups failed"
    )
    tensor_parallel_size: PositiveInt = Field(1, description="devices per engine, placed on one node")
    weight_sync: Literal["auto", "collective", "disk"] = Field(
        "auto",
        description="collective: trainer rank 0 broadcasts bucketed weights to the engines (gloo/NCCL/HCCL); "
        "disk: engines reload safetensors from weights_dir; auto: collective for vllm, disk for the others",
    )
    weights_dir: str | None = Field(
        None, description="weight_sync=disk: a folder every node sees (default: /dev/shm, one node only)"
    )
    weight_sync_delta: bool = Field(
        False,
        description="collective sync: per bucket, send only the elements that changed since the last sync (in the "
        "engines' dtype), when smaller; each end keeps a copy of the weights in host memory. Pays off with bf16 / "
        "fp16 engines, where a step changes a few percent of the elements; a float32 step changes nearly all",
    )
    weight_sync_timeout_s: PositiveFloat = Field(
        300.0,
        description="the weight-sync group's own timeout: joining it and each bucket's broadcast fail after this "
        "long (an engine dying or hanging in a sync fails that sync, not the trainer)",
    )
    weight_sync_ports: str | None = Field(
        None,
        description="collective sync across nodes: the port, or inclusive range FIRST-LAST, that trainer rank 0 "
        "listens on for the weight-sync group's store; the engines' nodes must reach it (open it in the firewall). "
        "Default: any free port, fine on one node or an open network",
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="extra Ray resources each engine asks for, e.g. to pin engines to nodes"
    )

    def sampling_for(self, split: str) -> SamplingConfig:
        """The sampling of a split's episodes: validation applies `val_sampling` on top of `sampling`."""
        if split != "val":
            return self.sampling
        changes = {k: v for k, v in self.val_sampling.model_dump().items() if v is not None}
        return self.sampling.model_copy(update=changes)

    @property
    def weight_sync_port_range(self) -> tuple[int, int] | None:
        """`weight_sync_ports` as (first, last), both included; None: any free port."""
        if self.weight_sync_ports is None:
            return None
        first, _, last = self.weight_sync_ports.partition("-")
        return int(first), int(last or first)

    @field_validator("weight_sync_ports", mode="before")
    @classmethod
    def _port_range(cls, value: Any) -> Any:
        if value is None:
            return None
        text = str(value).strip()  # YAML reads a lone port as an int
        first, sep, last = text.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"expected a port or a range FIRST-LAST, e.g. 29600-29609, got {value!r}") from None
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"expected ports 1-65535 with FIRST <= LAST, got {value!r}")
        return f"{lo}-{hi}" if sep else str(lo)

    @property
    def resolved_weight_sync(self) -> Literal["collective", "disk"]:
        """How weights reach the engines: `weight_sync`, with auto made concrete for the backend."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "collective" if self.backend == "vllm" else "disk"

    @model_validator(mode="after")
    def _remote_needs_url(self) -> RolloutConfig:
        if self.backend == "remote" and not self.url:
            raise ValueError("rollout.backend=remote needs rollout.url")
        if self.weight_sync == "collective" and self.backend != "vllm":
            raise ValueError(
                f"rollout.weight_sync=collective needs rollout.backend=vllm ({self.backend} reloads weights from "
                "disk): use weight_sync: disk or auto"
            )
        if self.weight_sync_delta and self.resolved_weight_sync != "collective":
            raise ValueError(
                f"rollout.weight_sync_delta needs the collective weight sync (this run's is "
                f"{self.resolved_weight_sync}: rollout.backend={self.backend}, weight_sync={self.weight_sync})"
            )
        return self

    @model_validator(mode="after")
    def _logprobs_of_the_sampled_distribution(self) -> RolloutConfig:
        """The trainer's log-probs are of the distribution the tokens were drawn from (temperature, top-k, top-p:
        agentrl.trainer.losses.SamplingDist), and so must the engine's behaviour log-probs be. SGLang's are after
        the temperature but before top-k / top-p (its sampler returns log(softmax(logits / T))), so with either
        they would be of another distribution than the one sampled and trained."""
        s = self.sampling
        if self.backend == "sglang" and s.temperature >= 1e-5 and (s.top_p < 1 or s.top_k > 0):  # 1e-5: greedy
            raise ValueError(
                f"rollout.backend=sglang reports log-probs before top-p / top-k, not of the distribution it samples "
                f"(top_p={s.top_p}, top_k={s.top_k}): set rollout.sampling.top_p: 1 and top_k: -1, or use "
                "backend: vllm"
            )
        return self


TINY_LR, MODEL_LR = 3e-4, 1e-6  # RL on the built-in tiny model; on a pretrained LLM
TINY_SFT_LR, MODEL_SFT_LR = 1e-3, 1e-5


class OptimConfig(Section):
    """AdamW and its schedule for the RL steps."""

    lr: PositiveFloat | None = Field(
        None, description=f"None: {TINY_LR:g} for builtin:tiny, {MODEL_LR:g} for any other (pretrained) model"
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: PositiveFloat = Field(1e-8, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="the lr after warm-up")
    grad_clip: PositiveFloat = Field(1.0, description="max global gradient norm")


class AlgorithmConfig(Section):
    """Advantages, the policy loss and its aggregation, KL and entropy terms."""

    advantage: Literal["grpo", "grpo_no_std", "rloo", "reinforce_pp", "turn_return", "gae"] = Field(
        "grpo",
        description="grpo(_no_std) / rloo: group-relative; reinforce_pp: batch-normalised; turn_return: per-turn "
        "returns-to-go; gae: a critic's values",
    )
    loss: Literal["decoupled_ppo", "ppo_clip"] = Field(
        "decoupled_ppo",
        description="decoupled_ppo: clipped against the proximal policy, truncated importance weights to the "
        "behaviour policy; ppo_clip: clipped against the behaviour log-probs",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "episode_mean"] = Field(
        "token_mean",
        description="episode_mean: every episode weighs the same however many turn-wise samples (turns) it has",
    )
    clip_low: float = Field(0.2, ge=0.0, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0.0, description="> clip_low is DAPO's clip-higher")
    dual_clip: float | None = Field(None, gt=1.0, description="dual-clip constant c (e.g. 3.0); None = off")
    is_truncation: float = Field(2.0, gt=0.0, description="truncate behaviour importance weights at this")
    is_level: Literal["token", "sequence"] = Field("token", description="importance weights per token or per sequence")
    kl_coef: float = Field(0.0, ge=0.0, description="KL to the initial policy (a reference model); 0: none")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="the KL estimator")
    kl_in_reward: bool = Field(False, description="the KL as a reward penalty instead of a loss term")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus in the loss")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount (turn_return, gae)")
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    ppo_epochs: PositiveInt = Field(1, description="passes over each batch")
    mini_batches: PositiveInt = Field(
        1, description="optimizer steps per batch and PPO epoch; proximal log-probs and advantages are computed once"
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_values(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("advantage") == "step_return":
            raise ValueError("advantage: step_return is now advantage: turn_return (per-turn returns-to-go)")
        return data


class SFTConfig(Section):
    """Warm start on expert demonstrations from the envs before RL."""

    enabled: bool = Field(False, description="run the warm start before RL")
    episodes: PositiveInt = Field(2000, description="expert demo episodes")
    steps: int = Field(200, ge=0, description="SFT optimizer steps")
    batch_size: PositiveInt = Field(64, description="demo samples per SFT step")
    lr: PositiveFloat | None = Field(
        None, description=f"None: {TINY_SFT_LR:g} for builtin:tiny, {MODEL_SFT_LR:g} for any other model"
    )
    expert_noise: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="chance that a demo turn takes a random move instead of the expert's (not trained on), so the "
        "demos also show the expert recovering from mistakes (DART); envs without tools only",
    )
    cache: bool = Field(
        False,
        description="reuse the warm start of an earlier run with the same model, train envs and SFT settings "
        "(whatever its seed), kept in model.cache_dir; a run that finds none saves its own there",
    )


class LoraConfig(Section):
    """Low-rank adapters (peft's LoRA) on a frozen base: only they train and hold optimizer state."""

    rank: PositiveInt = Field(16, description="r: the adapters' rank")
    alpha: PositiveFloat = Field(32.0, description="lora_alpha: the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="the linear layers that get adapters (their names' last part)",
    )
    warm_start: Literal["full", "adapters"] = Field(
        "full",
        description="what the SFT warm start (trainer.sft) trains. full: every weight, as without LoRA; RL then "
        "trains fresh adapters (B = 0) on the warm-started base, which the engines get once. A model that has "
        "not learnt the task's format (the tiny built-in one) needs this: adapters alone on a frozen embedding "
        "and norms stall (SFT loss 4.1 vs 0.2). adapters: the adapters only, for a base too big to fine-tune",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="what a weight sync sends. adapter: the adapters only; the engines (vLLM) serve them on the "
        "base they got once (at the first sync of a run, disk or collective). merged: the merged weights every "
        "time (any rollout backend)",
    )

    VLLM_RANKS: ClassVar[tuple[int, ...]] = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values


class MegatronConfig(Section):
    """Model-parallel sizes for `trainer.backend: megatron`; the data-parallel size is what remains of num_ranks."""

    tensor_parallel: PositiveInt = Field(1, description="ranks a layer's weights are split over")
    pipeline_parallel: PositiveInt = Field(1, description="pipeline stages (1F1B schedule)")
    context_parallel: PositiveInt = Field(1, description="must be 1 for now")
    expert_parallel: PositiveInt = Field(1, description="ranks MoE experts are split over")
    distributed_optimizer: bool = Field(True, description="shard optimizer state over data-parallel replicas")
    sequence_parallel: bool = Field(False, description="split layer-norm and dropout activations over TP ranks")

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


class TrainerConfig(Section):
    """The trainer: backend, ranks, steps, micro-batches, precision, and its optimizer, algorithm and warm start."""

    backend: Literal["fsdp2", "megatron"] = Field(
        "fsdp2", description="fsdp2: sharded data parallel; megatron: tensor/pipeline/context/expert parallel"
    )
    num_ranks: PositiveInt = Field(1, description="trainer ranks (one device each on GPU/NPU)")
    total_steps: PositiveInt = Field(100, description="RL steps: trained batches")
    micro_batch_tokens: PositiveInt = Field(8192, description="token budget per packed micro-batch")
    packing: Literal["pad", "packed"] = Field(
        "pad",
        description="micro-batch layout: rows padded to the longest (CPU) or one packed row + block mask",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: fp32 on CPU, bf16 compute (fp32 master weights and reductions) on GPU/NPU"
    )
    activation_checkpointing: bool | None = Field(
        None, description="recompute each decoder layer in backward; None = on for GPU/NPU, off on CPU"
    )
    cpu_offload: bool = Field(False, description="keep parameters, gradients and optimizer state in host memory")
    lora: LoraConfig | None = Field(
        None,
        description="train LoRA adapters on a frozen base (fsdp2; the engines get the merged weights); "
        "None: full fine-tuning",
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="extra Ray resources each trainer rank asks for, e.g. to pin it to a node"
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="model-parallel sizes (backend: megatron)"
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the RL optimizer")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="advantages and loss")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="the SFT warm start on the envs' experts")

    @model_validator(mode="after")
    def _parallel_sizes_fit(self) -> TrainerConfig:
        m = self.megatron
        if self.backend != "megatron":
            return self
        if self.lora is not None:
            raise ValueError("trainer.lora needs trainer.backend: fsdp2 (the Megatron backend trains every weight)")
        if self.num_ranks % m.model_parallel:
            raise ValueError(
                f"trainer.num_ranks={self.num_ranks} is not a multiple of tensor_parallel x pipeline_parallel x "
                f"context_parallel = {m.tensor_parallel} x {m.pipeline_parallel} x {m.context_parallel}"
            )
        dp = self.num_ranks // m.model_parallel
        if (dp * m.context_parallel) % m.expert_parallel:
            raise ValueError(
                f"trainer.megatron.expert_parallel={m.expert_parallel} must divide data_parallel x context_parallel "
                f"= {dp} x {m.context_parallel}"
            )
        if m.sequence_parallel and m.tensor_parallel == 1:
            raise ValueError("trainer.megatron.sequence_parallel needs tensor_parallel > 1")
        if m.context_parallel > 1:  # Megatron's CP attention is Transformer Engine's; agentrl does not drive it yet
            raise ValueError("trainer.megatron.context_parallel > 1 is not supported yet: use 1")
        return self


class AsyncConfig(Section):
    """How far rollout may run ahead of training (the staleness bound) and partial rollout."""

    max_staleness: int = Field(0, ge=0, description="0 = synchronous on-policy")
    partial_rollout: bool = Field(False, description="abort in-flight generations at weight updates and resume")
    drop_zero_variance_groups: bool = Field(False, description="DAPO-style filter: drop groups with equal returns")


class GatewayConfig(Section):
    """The OpenAI-compatible endpoint each env manager serves to agent programs (`envs.<split>.<tag>.agent`)."""

    host: str = Field(
        "127.0.0.1", description="bind address; off loopback needs token_env. Agents' routes need an episode's key"
    )
    token_env: str | None = Field(
        None,
        description="environment variable holding a bearer token for the routes no episode key guards (/health, "
        "the OpenAPI document); required off loopback, as for serve-tools",
    )
    model_name: str = Field("agentrl", description="the model id agents must ask for (task.model holds it)")
    agent_timeout_s: PositiveFloat = Field(300.0, description="wall time of one agent episode")
    max_body_bytes: PositiveInt = Field(4 << 20, description="largest request body")
    command_sandbox: bool = Field(
        True,
        description="jail agent commands (agent: 'cmd: ...'); false only inside a disposable container: they then "
        "reach whatever this machine can",
    )

    @model_validator(mode="after")
    def _token_off_loopback(self) -> GatewayConfig:
        from agentrl.addresses import is_loopback

        if self.token_env is None and not is_loopback(self.host):
            raise ValueError(
                f"gateway.host {self.host} is off loopback: set gateway.token_env to an environment variable holding "
                "a bearer token (as serve-tools' --token-env), or bind to 127.0.0.1"
            )
        if self.token_env is not None and not os.environ.get(self.token_env):
            raise ValueError(f"gateway.token_env {self.token_env}: the variable is not set or empty")
        return self

    def token(self) -> str | None:
        return os.environ[self.token_env] if self.token_env else None


class ValidationConfig(Section):
    """Held-out episodes (greedy by default) at step 0 and every `every_steps`."""

    every_steps: int = Field(10, ge=0, description="0 disables validation")
    episodes_per_tag: PositiveInt = Field(64, description="held-out episodes per env tag")
    seed_start: int = Field(1_000_000, description="first held-out task seed (far from the training seeds)")


class LoggingConfig(Section):
    """Where the run writes: run dir, metrics, TensorBoard, trackers, batches and logged episodes."""

    run_dir: str = Field("runs/{name}", description="{name} is replaced by the run name")
    console: bool = Field(True, description="progress on stderr (false: only the end-of-run table)")
    jsonl: bool = Field(True, description="RUN_DIR/metrics.jsonl (the viewer and the plot read it)")
    tensorboard: bool = Field(True, description="RUN_DIR/tensorboard; 'tensorboard' in trackers also turns it on")
    trackers: list[Literal["wandb", "mlflow", "swanlab", "tensorboard"]] = Field(
        default_factory=list,
        description="experiment trackers (pip install 'agentrl[tracking]'), written locally by default: wandb offline "
        "in RUN_DIR/wandb, MLflow file store RUN_DIR/mlruns, SwanLab offline in RUN_DIR/swanlog (WANDB_MODE, "
        "MLFLOW_TRACKING_URI, SWANLAB_MODE select their online modes); each gets the flat config, every metric under "
        "its agentrl name and the run's plot. 'tensorboard' here is the same as tensorboard: true",
    )
    project: str = Field("agentrl", description="the trackers' project (MLflow: experiment) name")
    save_batches: bool = Field(
        False,
        description="write every RL batch the trainer takes to RUN_DIR/batches/step-NNNNNN.jsonl.gz (its samples: "
        "tokens, masks, log-probs, versions, rewards; agentrl.run.batch_files.load_batch reads one back)",
    )
    sample_every_steps: int = Field(
        10,
        ge=0,
        description="every this many RL steps, and at every validation, write a few episodes per env tag to "
        "RUN_DIR/episodes/step-NNNNNN.jsonl (the chat turn by turn, tool calls, rewards, tokens with their policy "
        "versions and advantages) and to the trackers; `agentrl view RUN_DIR` shows them. 0: never",
    )
    sample_episodes: PositiveInt = Field(
        3, description="episodes per env tag each time: the lowest-return one, the highest, then random ones"
    )
    episodes_max_mb: float = Field(
        100.0,
        gt=0,
        description="RUN_DIR/episodes stays under this size: past it every other older file is removed",
    )

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_tracker(cls, data: Any) -> Any:
        """'tensorboard' in trackers is an alias of tensorboard: true (one place to look: the tensorboard field)."""
        if isinstance(data, dict) and isinstance(data.get("trackers"), list) and "tensorboard" in data["trackers"]:
            if data.get("tensorboard") is False:
                raise ValueError("trackers lists 'tensorboard' but tensorboard is false: keep one of them")
            data = {**data, "tensorboard": True, "trackers": [t for t in data["trackers"] if t != "tensorboard"]}
        return data


class CheckpointConfig(Section):
    """Checkpoints of the trainer and the run state, and resuming from them."""

    every_steps: int = Field(0, ge=0, description="0 saves only at the end")
    keep_last: PositiveInt = Field(2, description="checkpoints kept; older ones are removed")
    resume: Literal["auto", "never"] = Field("auto", description="auto: resume from the run dir's latest checkpoint")


class Config(Section):
    name: str = Field("agentrl", description="the run's name: names its run dir and its tracker runs")
    seed: int = Field(
        0, description="seeds the trainer (initial weights, mini-batch shuffles) and the engines' samplers"
    )
    ray_address: str | None = Field(None, description="None = start local Ray; 'auto' or host:port = join a cluster")
    platform: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="auto: from the Ray cluster's resources (NPU, else GPU, else CPU), not the driver's node"
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    envs: EnvsConfig = Field(default_factory=EnvsConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    # keys whose unset value follows the model (`load_config` keeps them unset under overrides of model.path)
    MODEL_DEFAULTS: ClassVar[tuple[str, ...]] = ("trainer.optim.lr", "trainer.sft.lr")

    @model_validator(mode="after")
    def _learning_rates_for_the_model(self) -> Config:
        """Unset learning rates follow the model: the tiny model's (3e-4) would wreck a pretrained LLM in a few
        steps, and a pretrained model's (1e-6) would leave the tiny one where it started."""
        tiny = self.model.path.startswith("builtin:")
        optim, sft = self.trainer.optim, self.trainer.sft
        if optim.lr is None:
            optim.lr = TINY_LR if tiny else MODEL_LR
        if sft.lr is None:
            sft.lr = TINY_SFT_LR if tiny else MODEL_SFT_LR
        return self

    @model_validator(mode="after")
    def _episodes_fit_the_engines(self) -> Config:
        """An episode may grow to envs.max_total_tokens; an engine serves prompts up to rollout.max_model_len: a
        longer cap would let late turns fail at the engine instead of ending the episode (truncation)."""
        cap, room = self.envs.max_total_tokens, self.rollout.max_model_len
        if self.rollout.backend != "remote" and cap > room:
            raise ValueError(
                f"envs.max_total_tokens ({cap}) exceeds rollout.max_model_len ({room}): the engines would reject an "
                "episode's later turns; lower envs.max_total_tokens or raise rollout.max_model_len"
            )
        return self

    @model_validator(mode="after")
    def _engines_can_serve_the_adapters(self) -> Config:
        lora, ro = self.trainer.lora, self.rollout
        if lora is None or lora.sync != "adapter":
            return self
        if ro.backend != "vllm":
            raise ValueError(f"trainer.lora.sync: adapter needs rollout.backend: vllm ({ro.backend} cannot load "
                             "adapters here): set trainer.lora.sync: merged")  # fmt: skip
        if lora.rank not in lora.VLLM_RANKS:
            raise ValueError(f"trainer.lora.rank {lora.rank}: vLLM serves adapters of rank "
                             f"{', '.join(map(str, lora.VLLM_RANKS))} (or set trainer.lora.sync: merged)")  # fmt: skip
        if ro.weight_sync_delta:
            raise ValueError("rollout.weight_sync_delta with trainer.lora.sync: adapter: an adapter sync is already "
                             "small; turn one of them off")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _tool_sets_exist(self) -> Config:
        for tag, spec in {**self.envs.train, **self.envs.val}.items():
            for name in spec.tools:
                if name not in self.tools.sets:
                    known = ", ".join(sorted(self.tools.sets)) or "none defined"
                    raise ValueError(f"envs.{tag}.tools names unknown tool set {name!r} (tools.sets: {known})")
        return self

    @property
    def run_dir(self) -> str:
        return self.logging.run_dir.replace("{name}", self.name)
