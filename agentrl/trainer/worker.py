"""One trainer rank (a Ray actor): FSDP2 policy (+ reference, + critic), RL and SFT steps, export, checkpoint.

Every rank receives the whole batch (one ray.put by the driver), computes the sequence-level advantages and
the global loss denominators for all of it (cheap and identical everywhere), then works on its token-balanced
shard. Each micro-batch's loss is divided by the *global* denominator (its share of the global loss; the backend
sums the shares' gradients over micro-batches and ranks), so 1 rank and N ranks take the same optimizer step up to
float rounding.

Devices and collectives. The default group is "cpu:gloo,<device>:<nccl|hccl>" (`Platform.process_group_backend`).
Rule: a collective runs where its values already live. Model tensors (FSDP2's all-gathers and reduce-scatters, the
grad norm) stay on the rank's device and use NCCL/HCCL; step bookkeeping (micro-batch counts, loss denominators,
metric sums, object gathers) is host data and goes over gloo as CPU tensors, so it never costs a device copy.
Everything that enters the model or a loss is on `self.device`: each collated micro-batch is moved there once,
and metric sums stay there until one device-to-host copy at the end of a step. `AGENTRL_STRICT_DEVICES=1` (or
`STRICT_DEVICES = True`) checks both rules at the collate output, the loss entry and before every collective.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from agentrl.config.schema import Config
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import configure_cpu_threads, detect
from agentrl.trainer import advantages as adv_lib
from agentrl.trainer import losses
from agentrl.trainer.backends import ModelBackend, TrainOptimizer, create_backend
from agentrl.trainer.batching import (
    LAYOUT_KEYS,
    LazyMicroBatches,
    collate,
    micro_batches,
    scatter_back,
    shard_indices,
    to_device,
)
from agentrl.trainer.checkpoint import copy_hf_side_files, rng_state, set_rng_state
from agentrl.trainer.model import uses_flash_attention
from agentrl.trainer.weight_publish import WeightPublisher
from agentrl.types import REPORTED_ADVANTAGES, Sample
from agentrl.weight_buckets import GroupCache, PackBuffer

RL_SUMS = ("loss", "pg_loss", "kl", "entropy", "clipped", "dual_clipped", "tokens", "ratio", "is_weight",
           "is_truncated", "value_loss", "skipped")  # fmt: skip
SFT_SUMS = ("loss", "correct")

STRICT_DEVICES = os.environ.get("AGENTRL_STRICT_DEVICES", "") == "1"


def _check_device(tensors: Iterable[Any], device: torch.device, where: str) -> None:
    """With STRICT_DEVICES: every tensor among `tensors` is on `device` (a CPU tensor in a device computation
    fails late and far from its cause, or silently syncs)."""
    if not STRICT_DEVICES:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise RuntimeError(f"{where}: tensor of shape {tuple(t.shape)} on {t.device}, expected {device}")


def _compute_tensors(batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The micro-batch tensors the model and the losses read (all but the host-side layout keys)."""
    return [v for k, v in batch.items() if k not in LAYOUT_KEYS]


def _host_all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """all_reduce of step bookkeeping: a CPU tensor over the group's gloo backend (the module's collective rule).
    `group`: the backend's data-parallel group for sums over the batch (tensor-parallel peers hold copies)."""
    if STRICT_DEVICES:
        devices = {pair.split(":")[0] for pair in dist.get_backend_config(group).split(",")}
        if t.device.type != "cpu" or "cpu" not in devices:
            raise RuntimeError(f"bookkeeping collective on {t.device} in a group for {sorted(devices)}")
    dist.all_reduce(t, op=op, group=group)
    return t


class RankSums:
    """Named sums over micro-batches, added over ranks in one collective at the end of a step.

    Values may be 0-dim device tensors: they stay on the device (no host sync per micro-batch) and reach the host
    in one copy, where they are added in float64. Every rank declares the same names, so the reduced vectors line
    up; the order lives only in here.
    """

    def __init__(self, names: Iterable[str], group=None) -> None:
        self._names = tuple(names)
        self._group = group  # the data-parallel group: each replica's sums once
        self._rows: list[torch.Tensor] = []  # one float32 vector per micro-batch, on the values' device

    def add(self, values: Mapping[str, float | torch.Tensor]) -> None:
        """Add one micro-batch's values; a name not declared is an error (ranks would disagree on the shape)."""
        for name in values:
            if name not in self._names:
                raise KeyError(f"undeclared sum {name!r} (declared: {', '.join(self._names)})")
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        row = [values.get(n, 0.0) for n in self._names]
        self._rows.append(
            torch.stack([
                v.detach().float().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=device)
                for v in row
            ])
        )  # fmt: skip

    def all_reduce(self) -> dict[str, float]:
        """Collective: the sums over micro-batches and ranks (names never added stay 0)."""
        total = torch.zeros(len(self._names), dtype=torch.float64)
        if self._rows:
            total += torch.stack(self._rows).to("cpu", torch.float64).sum(0)
        _host_all_reduce(total, group=self._group)
        return dict(zip(self._names, total.tolist(), strict=True))


@dataclass
class _RLBatch:
    """What all optimizer steps of one train_step share, computed once before the first of them."""

    samples: list[Sample]
    mine: list[int]  # this rank's shard of the batch
    fields: dict[str, dict[int, list[float]]]  # per-token loss inputs of this rank's samples, by sample index
    model_tokens: list[int]  # per sample: tokens the loss can weigh (loss-mask tokens after the first)
    episode_w: list[float] | None  # per sample, episode_mean only: 1 / model tokens of its episode
    prompts: tuple[list[int], list[tuple[int, ...]]]  # `_prompts(samples)`, for every mini-batch's plan
    no_gradient: set[int]  # this rank's samples whose loss has no gradient (`_without_gradient`)


class TrainerRank(WeightPublisher):
    @staticmethod
    def rendezvous_address() -> tuple[str, int]:
        """This node's IP and a free port: rank 0 hosts the process group's TCP store (multi-node safe)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def __init__(self, cfg: dict, model_path: str, rank: int, world_size: int) -> None:
        self.cfg = Config.model_validate(cfg)
        self.tc = self.cfg.trainer
        self.alg = self.tc.algorithm
        # The distribution every token of a trained sample was drawn from (one `rollout.sampling` for every env tag):
        # RL log-probs and entropies are of it, as the engines' behaviour log-probs are; SFT's are the model's own.
        self.sampling_dist = losses.SamplingDist.of(self.cfg.rollout.sampling)
        self.rank, self.world = rank, world_size
        self.model_path = model_path
        plat = detect()
        if plat.kind == "cpu":
            configure_cpu_threads(1)
        device_module = plat.device_module()  # torch.cuda / torch.npu; imports torch_npu, which "npu" devices need
        self.device = plat.torch_device(0)  # Ray makes the rank's one device visible as index 0
        if device_module is not None:
            device_module.set_device(self.device)
        self.plat = plat
        self._sync_groups = GroupCache()  # rank 0's group with the engine workers (collective weight sync)
        self._pack_buffer = PackBuffer()  # rank 0's bucket buffer, reused across buckets and syncs

    def setup(self, addr: str, port: int) -> int:
        """Join the process group and build models and optimizers (a separate call: rank 0's address first)."""
        self.model_path = resolve_model_path(self.model_path)  # a hub id: a snapshot in this node's HF cache
        plat, model_path = self.plat, self.model_path
        if not dist.is_initialized():  # a test may build several ranks in one process (world size 1)
            dist.init_process_group(
                plat.process_group_backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world
            )
        torch.manual_seed(self.cfg.seed)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        self.pad_id = hf_config.pad_token_id or 0
        self.tied = bool(hf_config.tie_word_embeddings)
        self.backend: ModelBackend = create_backend(self.tc.backend, self.cfg, model_path, self.device, plat)
        self.model = self.backend.build("policy")  # precision, checkpointing, offload: trainer config
        self.ref = None
        if self.alg.kl_coef > 0:
            self.ref = self.backend.build("reference")  # eval mode, no grads, stored in the compute dtype
        self.critic = None
        opt_steps = self.tc.total_steps * self.alg.ppo_epochs * self.alg.mini_batches
        if self.alg.advantage == "gae":
            self.critic = self.backend.build("critic")
            self.critic_opt = self.backend.optimizer(self.critic, opt_steps)
        self.opt: TrainOptimizer = self.backend.optimizer(self.model, opt_steps)
        self.sft_opt: TrainOptimizer | None = None
        self.version = 0  # policy version = RL batches trained (train_step calls); the initial weights are 0
        self.optimizer_steps = 0  # every optimizer step: RL mini-batches and SFT steps
        return self.version

    # ---- batch plumbing ------------------------------------------------------------------------------------

    def _plan(
        self,
        samples: list[Sample],
        mine: list[int] | None = None,
        shared: bool = False,
        prompts: tuple[list[int], list[tuple[int, ...]]] | None = None,
    ) -> list[list[int]]:
        """This rank's micro-batches (of its data-parallel shard, or of `mine`), padded with empty ones to the max
        count over ranks (collectives). `shared`: every pass over them runs repeated prompts once (the budget
        then counts a prompt once, not once per row). `prompts`: `_prompts(samples)`, when the step has it."""
        lengths = [len(s.token_ids) for s in samples]
        if mine is None:
            mine = shard_indices(lengths, self.backend.dp_size)[self.backend.dp_rank]
        keys, tokens = prompts or _prompts(samples)
        shares = shared and self.tc.packing == "pad"
        mbs = micro_batches(
            mine, lengths, self.tc.micro_batch_tokens, self.tc.packing, keys, tokens if shares else None
        )
        n = _host_all_reduce(torch.tensor([len(mbs)]), dist.ReduceOp.MAX)
        return mbs + [[] for _ in range(max(int(n), 1) - len(mbs))]

    def _shares_prompts(self, grad: bool) -> bool:
        """Whether every model pass over a plan's micro-batches runs repeated prompts once: the critic's value
        pass reuses the policy's plan and runs every row whole."""
        return self.critic is None and self.backend.shares_prompts(self.model, grad)

    def _batch(self, samples: list[Sample], idx: list[int], fields: dict[str, dict[int, list[float]]]) -> dict:
        """Collate micro-batch `idx` onto the rank's device; an empty one is a 2-token dummy, loss mask 0 (keeps
        FSDP in step)."""
        layout, block_mask = self.tc.packing, not uses_flash_attention(self.model)
        if not idx:
            batch = collate([[self.pad_id] * 2], {k: [[0.0, 0.0]] for k in fields}, layout, self.pad_id, block_mask)
        else:
            toks = [samples[i].token_ids for i in idx]
            batch = collate(toks, {k: [v[i] for i in idx] for k, v in fields.items()}, layout, self.pad_id, block_mask)
        batch = to_device(batch, self.device)
        _check_device(_compute_tensors(batch), self.device, "collated micro-batch")
        return batch

    def _micro_batches(self, samples: list[Sample], mbs: list[list[int]], fields: dict) -> LazyMicroBatches:
        return LazyMicroBatches(lambda idx: self._batch(samples, idx, fields), mbs)

    @torch.no_grad()
    def _logprob_pass(
        self, model, samples: list[Sample], mbs: list[list[int]], every_token: bool = False
    ) -> dict[int, list[float]]:
        """Log-probs (of the sampling distribution) of the loss-mask tokens (0 elsewhere), or of every token (values,
        for the critic)."""
        masks = {} if every_token else {"loss_mask": {i: s.loss_mask for i, s in enumerate(samples)}}
        batches = self._micro_batches(samples, mbs, masks)
        outs = self.backend.forward_backward(model, batches, forward_only=True, sampling_dist=self.sampling_dist)
        out: dict[int, list[float]] = {}
        for idx, layout, per_token in zip(mbs, batches.layouts, outs, strict=True):
            out.update(zip(idx, scatter_back(per_token, layout), strict=False))
        return out

    def _value_pass(self, samples: list[Sample], mbs: list[list[int]]) -> dict[int, list[float]]:
        return self._logprob_pass(self.critic, samples, mbs, every_token=True)

    def _gather(self, local: dict[int, Any]) -> dict[int, Any]:
        group = self.backend.dp_group
        parts: list[dict[int, Any]] = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(parts, local, group=group)
        return {k: v for p in parts for k, v in p.items()}

    # ---- advantages ----------------------------------------------------------------------------------------

    def _advantages(self, samples, mine, prox, ref, values) -> tuple[dict[int, list[float]], dict, list[float]]:
        """Per-token advantages for this rank's samples (+ value targets for GAE), and shaped rewards."""
        alg = self.alg
        rewards = [s.reward for s in samples]
        token_kl: dict[int, list[float]] = {}
        if alg.kl_in_reward and ref is not None:
            cur = prox if prox is not None else {i: samples[i].logprobs for i in mine}
            for i in mine:
                m = samples[i].loss_mask
                token_kl[i] = [-alg.kl_coef * (a - b) * mk for a, b, mk in zip(cur[i], ref[i], m, strict=True)]
            kl_sum = self._gather({i: sum(v) for i, v in token_kl.items()})
            if alg.advantage != "gae":  # GAE takes the penalty per token instead
                rewards = [r + kl_sum[i] for i, r in enumerate(rewards)]
        if alg.advantage == "gae":
            sub = [samples[i] for i in mine]
            kl = [token_kl[i] for i in mine] if token_kl else None
            a, r = adv_lib.gae_advantages(sub, [values[i] for i in mine], alg.gamma, alg.gae_lambda, kl)
            return dict(zip(mine, a, strict=True)), dict(zip(mine, r, strict=True)), rewards
        if alg.advantage == "step_return":
            shaped = [s if s.reward == r else _with_reward(s, r) for s, r in zip(samples, rewards, strict=True)]
            a = adv_lib.step_return_advantages(shaped, alg.gamma)
            return {i: a[i] for i in mine}, {}, rewards
        seq = adv_lib.sequence_advantages(
            alg.advantage, rewards, [s.group_id for s in samples], [s.episode_id for s in samples]
        )
        return {i: adv_lib.spread(seq[i], samples[i].loss_mask) for i in mine}, {}, rewards

    def _episode_token_weights(self, samples: list[Sample], model_tokens: list[int]) -> list[float]:
        """episode_mean: 1 / (model tokens of the sample's episode over the whole batch), per sample."""
        per_episode: dict[str, int] = {}
        for s, n in zip(samples, model_tokens, strict=True):
            per_episode[s.episode_id] = per_episode.get(s.episode_id, 0) + n
        return [1.0 / max(per_episode[s.episode_id], 1) for s in samples]

    def _denom(self, rl: _RLBatch, part: list[int]) -> float:
        """Global denominator of the samples in `part` over all ranks: the sum of their token weights, i.e.
        model tokens (token_mean), sequences with any (seq_mean_*) or episodes (episode_mean, fractional when an
        episode's turns fall into several mini-batches)."""
        counts = [rl.model_tokens[i] for i in part]
        if rl.episode_w is not None:
            local = sum(c * rl.episode_w[i] for c, i in zip(counts, part, strict=True))
        elif self.alg.loss_agg == "token_mean":
            local = float(sum(counts))
        else:
            local = float(sum(1 for c in counts if c))
        return float(_host_all_reduce(torch.tensor([local], dtype=torch.float64), group=self.backend.dp_group))

    def _mini_batches(self, samples: list[Sample], mine: list[int]) -> list[list[int]]:
        """This rank's samples split into `mini_batches` parts (as many on every rank), whole groups to a part:
        a group's episodes share their prompts (the same task, often the same states), which the trainer then
        runs once. Groups are shuffled anew each step (seeded by the policy version, so a resumed run shuffles
        as the uninterrupted one would) and dealt to the part holding the fewest samples so far."""
        groups: dict[str, list[int]] = {}
        for i in sorted(mine):  # batch order, not the micro-batch planner's: the parts must not depend on it
            groups.setdefault(samples[i].group_id, []).append(i)
        k = max(1, min(self.alg.mini_batches, len({s.group_id for s in samples})))  # the same on every rank
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + self.version * 1009 + self.backend.dp_rank)
        members = list(groups.values())
        parts: list[list[int]] = [[] for _ in range(k)]
        for j in torch.randperm(len(members), generator=g).tolist():
            min(parts, key=len).extend(members[j])
        return [sorted(p) for p in parts]

    # ---- steps ---------------------------------------------------------------------------------------------

    def train_step(self, samples: list[Sample], report: Sequence[int] = ()) -> dict[str, Any]:
        """One RL step: proximal/ref log-probs and advantages once for the batch, then `ppo_epochs` x
        `mini_batches` optimizer steps. The proximal policy stays the one from before the first optimizer
        step, so clipping bounds how far all of them together move it (the trust region).

        `report`: batch positions whose per-token advantages come back under REPORTED_ADVANTAGES (gathered
        from every rank; the same list on every rank), for the episodes the run logs."""
        t0 = time.perf_counter()
        if self.sft_opt is not None:  # the warm start is over: free its AdamW moments (2 fp32 copies of the params)
            self.sft_opt = None
            self.opt.sync_from_model()
        rl = self._prepare(samples)
        gap = self._rollout_gap(samples, rl.fields.get("prox"))
        reported = self._gather({i: rl.fields["adv"][i] for i in report if i in rl.fields["adv"]}) if report else {}
        sums, grad_norms, lrs = self._optimize(rl)
        self.version += 1
        self.optimizer_steps += len(grad_norms)
        out: dict[str, Any] = {**self._summarize(rl, sums, grad_norms, lrs, t0), **gap}
        if report:
            out[REPORTED_ADVANTAGES] = reported
        return out

    def _rollout_gap(self, samples: list[Sample], prox: dict[int, list[float]] | None) -> dict[str, float]:
        """`train/rollout_logprob_diff`: mean |engine log-prob - trainer log-prob| over the model tokens sampled at
        the trainer's current version. It checks the last weight sync: near 0 when the engines hold exactly the
        trainer's weights (the rest is numerics), large when a sync was lost or wrong. Collective over ranks."""
        if prox is None:
            return {}
        total, count = 0.0, 0
        for i, trainer_lp in prox.items():
            s = samples[i]
            for t, lp in enumerate(trainer_lp):
                if s.loss_mask[t] and s.versions[t] == self.version:
                    total += abs(s.logprobs[t] - lp)
                    count += 1
        summed = _host_all_reduce(torch.tensor([total, count], dtype=torch.float64), group=self.backend.dp_group)
        return {"train/rollout_logprob_diff": float(summed[0] / summed[1])} if summed[1] else {}

    def _prepare(self, samples: list[Sample]) -> _RLBatch:
        """Under the weights from before this step: the micro-batch plan, the proximal / reference log-probs
        and values, advantages, and every per-token input of the loss."""
        alg = self.alg
        prompts = _prompts(samples)
        mbs = self._plan(samples, shared=self._shares_prompts(grad=False), prompts=prompts)
        mine = [i for mb in mbs for i in mb]
        self.model.eval()
        prox = self._logprob_pass(self.model, samples, mbs) if alg.loss == "decoupled_ppo" else None
        ref = self._logprob_pass(self.ref, samples, mbs) if self.ref is not None else None
        values = self._value_pass(samples, mbs) if self.critic is not None else None
        advs, returns, _ = self._advantages(samples, mine, prox, ref, values)
        fields: dict[str, dict[int, list[float]]] = {
            "loss_mask": {i: samples[i].loss_mask for i in mine},
            "behav": {i: samples[i].logprobs for i in mine},
            "adv": advs,
        }
        if prox is not None:
            fields["prox"] = prox
        if ref is not None:
            fields["ref"] = ref
        if values is not None:
            fields["old_values"], fields["returns"] = values, returns
        model_tokens = [sum(s.loss_mask[1:]) for s in samples]
        episode_w = self._episode_token_weights(samples, model_tokens) if alg.loss_agg == "episode_mean" else None
        if episode_w is not None:
            fields["token_weight"] = {i: [episode_w[i]] * len(samples[i].token_ids) for i in mine}
        return _RLBatch(samples, mine, fields, model_tokens, episode_w, prompts, self._without_gradient(mine, advs))

    def _without_gradient(self, mine: list[int], advs: dict[int, list[float]]) -> set[int]:
        """This rank's samples whose every advantage is 0 (a GRPO/RLOO group whose episodes all returned the
        same) while the loss has no KL, entropy or value term: their loss and gradient are exactly 0, so the optimizer
        steps skip their forward and backward (0-30% of a Sokoban batch, 15% in the median step). They keep
        their share of every denominator, so each step moves the weights exactly as it would with them;
        `train/entropy` and the clip and ratio statistics then cover the trained samples.

        One data-parallel replica only: skipping more samples on one rank than on another leaves their
        micro-batches (a padding one beside a prompt-sharing one) making different model calls, which FSDP2 ranks
        then run plain (`FSDP2Backend._agreed_plan`): slower, and larger than the budget assumed."""
        alg = self.alg
        if self.backend.dp_size > 1 or self.critic is not None or self.ref is not None or alg.entropy_coef > 0:
            return set()
        return {i for i in mine if not any(advs[i])}

    def _optimize(self, rl: _RLBatch) -> tuple[dict[str, float], list[float], list[float]]:
        """`ppo_epochs` x `mini_batches` optimizer steps; returns the loss sums over all ranks, and each step's
        grad norm and lr."""
        sums = RankSums(RL_SUMS, self.backend.dp_group)
        skipped = float(len(rl.no_gradient))
        sums.add({"skipped": torch.tensor(skipped, device=self.device)})  # on the device, like every other row
        grad_norms, lrs = [], []
        self.model.train()
        for _ in range(self.alg.ppo_epochs):
            for part in self._mini_batches(rl.samples, rl.mine):
                denom = self._denom(rl, part)
                self.opt.zero_grad()
                if self.critic is not None:
                    self.critic_opt.zero_grad()
                trained = [i for i in part if i not in rl.no_gradient]
                mbs = self._plan(rl.samples, trained, shared=self._shares_prompts(grad=True), prompts=rl.prompts)
                rows = self.backend.forward_backward(
                    self.model, self._micro_batches(rl.samples, mbs, rl.fields), partial(self._rl_loss, denom=denom),
                    with_entropy=True, entropy_grad=self.alg.entropy_coef > 0, sampling_dist=self.sampling_dist,
                )  # fmt: skip
                if self.critic is not None:
                    batches = self._micro_batches(rl.samples, mbs, rl.fields)
                    values = self.backend.forward_backward(self.critic, batches, partial(self._value_loss, denom=denom))
                    rows = [{**r, **v} for r, v in zip(rows, values, strict=True)]
                for row in rows:
                    sums.add(row)
                lrs.append(self.opt.lr)
                grad_norms.append(self.opt.step())
                if self.critic is not None:
                    self.critic_opt.step()
        return sums.all_reduce(), grad_norms, lrs

    def _summarize(
        self, rl: _RLBatch, m: dict[str, float], grad_norms: list[float], lrs: list[float], t0: float
    ) -> dict[str, float]:
        """The step's metrics: losses per optimizer step, token statistics per trained model token (over all
        epochs)."""
        samples = rl.samples
        n_opt, tok = len(grad_norms), max(m["tokens"], 1.0)
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(s.token_ids) for s in samples)
        out = {
            "train/loss": m["loss"] / n_opt,
            "train/pg_loss": m["pg_loss"] / n_opt,
            "train/kl": m["kl"] / tok,
            "train/entropy": m["entropy"] / tok,
            "train/clip_frac": m["clipped"] / tok,
            "train/dual_clip_frac": m["dual_clipped"] / tok,
            "train/ratio_mean": m["ratio"] / tok,
            "train/grad_norm": sum(grad_norms) / n_opt,
            "train/lr": lrs[-1],
            "train/optimizer_steps": float(n_opt),
            "train/tokens": float(n_tokens),
            "train/model_tokens": float(sum(rl.model_tokens)),  # the whole batch's, trained or skipped
            "train/step_time": elapsed,
            "train/tokens_per_s": n_tokens * self.alg.ppo_epochs / elapsed,
            "train/zero_advantage_frac": m["skipped"] / max(len(samples), 1),  # samples the optimizer skipped
        }
        if self.alg.loss == "decoupled_ppo":
            out["train/is_weight_mean"] = m["is_weight"] / tok
            out["train/is_truncated_frac"] = m["is_truncated"] / tok
        if self.critic is not None:
            out["train/value_loss"] = m["value_loss"] / n_opt
        return out

    def _rl_loss(self, batch: dict, logp: torch.Tensor, ent: torch.Tensor | None, denom: float):
        """The policy loss of one micro-batch (its share of the mini-batch's, `denom` global) and its named sums."""
        alg = self.alg
        mask, seq = batch["loss_mask"], batch["seq_ids"]
        w = self._weights(batch)
        _check_device([logp, ent, w, *_compute_tensors(batch)], self.device, "loss inputs")
        clip = {"clip_low": alg.clip_low, "clip_high": alg.clip_high, "dual_clip": alg.dual_clip}
        if alg.loss == "decoupled_ppo":
            pg, st = losses.decoupled_ppo_loss(
                logp, batch["prox"], batch["behav"], batch["adv"], w, denom, seq,
                is_truncation=alg.is_truncation, is_level=alg.is_level, **clip,
            )  # fmt: skip
        else:
            pg, st = losses.ppo_clip_loss(logp, batch["behav"], batch["adv"], w, denom, **clip)
        total = pg
        old = batch["ref"] if "ref" in batch else batch.get("prox", batch["behav"])
        kl_tok = losses.kl_penalty(logp, old, alg.kl_estimator)
        if "ref" in batch and not alg.kl_in_reward:
            total = total + alg.kl_coef * losses.aggregate(kl_tok, w, denom)
        if alg.entropy_coef:
            total = total - alg.entropy_coef * losses.aggregate(ent, w, denom)
        sums = {"loss": total, "pg_loss": pg, "kl": (kl_tok * mask).sum(), "entropy": (ent * mask).sum(), **st}
        _check_device(sums.values(), self.device, "loss outputs")
        return total, sums  # sums stay on the device: RankSums copies them to the host once

    def _weights(self, batch: dict) -> torch.Tensor:
        """Per-token loss weights; episode_mean's come precomputed (they depend on the whole batch's episodes)."""
        mask = batch["loss_mask"]
        if "token_weight" in batch:
            return mask * batch["token_weight"]
        return losses.token_weights(mask, batch["seq_ids"], self.alg.loss_agg)

    def _value_loss(self, batch: dict, v: torch.Tensor, _ent, denom: float):
        loss = losses.value_loss(v, batch["old_values"], batch["returns"], self._weights(batch), denom)
        return loss, {"value_loss": loss}

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """Cross-entropy on loss-mask tokens, token-mean over the batch; its own AdamW at trainer.sft.lr.
        A warm start, not an RL batch: it leaves the policy version alone."""
        t0 = time.perf_counter()
        if self.sft_opt is None:
            self.sft_opt = self._sft_optimizer()
        mbs = self._plan(samples, shared=self._shares_prompts(grad=True))
        fields = {"loss_mask": {i: s.loss_mask for i, s in enumerate(samples)}}
        denom = float(sum(sum(s.loss_mask[1:]) for s in samples))
        self.model.train()
        self.sft_opt.zero_grad()
        sums = RankSums(SFT_SUMS, self.backend.dp_group)
        batches = self._micro_batches(samples, mbs, fields)
        for row in self.backend.forward_backward(self.model, batches, partial(_sft_loss, denom=denom)):
            sums.add(row)
        lr = self.sft_opt.lr
        norm = self.sft_opt.step()
        self.optimizer_steps += 1
        m = sums.all_reduce()
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(s.token_ids) for s in samples)
        return {
            "sft/loss": m["loss"],
            "sft/token_acc": m["correct"] / max(denom, 1.0),
            "sft/grad_norm": norm,
            "sft/lr": lr,
            "sft/step_time": elapsed,
            "sft/tokens_per_s": n_tokens / elapsed,
        }

    def compute_logprobs(self, samples: list[Sample]) -> dict[int, list[float]]:
        """This rank's share of the batch's log-probs under the current weights, of the distribution the engines
        sample from (merged by the driver)."""
        self.model.eval()
        return self._logprob_pass(self.model, samples, self._plan(samples), every_token=True)

    # ---- weights and state ---------------------------------------------------------------------------------

    def _sft_optimizer(self) -> TrainOptimizer:
        """AdamW at trainer.sft.lr, constant: the warm start keeps trainer.optim's betas, eps, decay and clipping,
        not the RL run's warmup and schedule (which count RL steps)."""
        sft = self.tc.optim.model_copy(update={"lr": self.tc.sft.lr, "schedule": "constant", "warmup_steps": 0})
        return self.backend.optimizer(self.model, max(self.tc.sft.steps, 1), sft)

    def _optimizers(self) -> dict[str, TrainOptimizer]:
        opts = {"optim": self.opt}
        if self.sft_opt is not None:
            opts["sft_optim"] = self.sft_opt
        if self.critic is not None:
            opts["critic_optim"] = self.critic_opt
        return opts

    def _models(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.model, **({"critic": self.critic} if self.critic is not None else {})}

    def save_checkpoint(self, ckpt_dir: str) -> str:
        """Collective: models, optimizers and their schedules (the backend's format), RNG, policy version and
        optimizer steps; then rank 0 writes `hf/` (config and tokenizer, for `agentrl export`) and `meta.json`,
        last, so a checkpoint with a meta.json is complete."""
        import json

        extra = {
            "rng": rng_state(self.plat.device_module(), self.device),
            "version": self.version,
            "optimizer_steps": self.optimizer_steps,
        }
        self.backend.save_checkpoint(ckpt_dir, self._models(), self._optimizers(), extra)
        if self.rank == 0:
            copy_hf_side_files(self.model_path, os.path.join(ckpt_dir, "hf"))
            meta = {"version": self.version, "optimizer_steps": self.optimizer_steps, "world_size": self.world,
                    "backend": self.tc.backend, "optimizers": sorted(self._optimizers())}  # fmt: skip
            with open(os.path.join(ckpt_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
        dist.barrier()
        return ckpt_dir

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Collective inverse of `save_checkpoint`; returns the restored policy version."""
        import json

        with open(os.path.join(ckpt_dir, "meta.json")) as f:
            meta = json.load(f)
        backend = meta.get("backend", "fsdp2")
        if backend != self.tc.backend:
            raise ValueError(f"{ckpt_dir} was saved by trainer.backend={backend}, this run uses {self.tc.backend}")
        saved = meta.get("optimizers", [])
        if "sft_optim" in saved and self.sft_opt is None:
            self.sft_opt = self._sft_optimizer()
        opts = {k: v for k, v in self._optimizers().items() if k in saved}
        extra = self.backend.load_checkpoint(ckpt_dir, self._models(), opts)
        set_rng_state(extra["rng"], self.plat.device_module(), self.device)
        self.version, self.optimizer_steps = int(extra["version"]), int(extra["optimizer_steps"])
        return self.version

    def shutdown(self) -> None:
        self._sync_groups.close()
        if getattr(self, "backend", None) is not None:
            self.backend.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _sft_loss(batch: dict, logp: torch.Tensor, _ent, denom: float):
    w = losses.token_weights(batch["loss_mask"], batch["seq_ids"], "token_mean")
    _check_device([logp, w, *_compute_tensors(batch)], logp.device, "loss inputs")
    loss = losses.sft_loss(logp, w, denom)
    correct = ((logp > -0.6931) * batch["loss_mask"]).sum()  # p > 0.5: greedy-correct lower bound
    return loss, {"loss": loss, "correct": correct}


def _prompts(samples: list[Sample]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Per sample, its prompt's rank in sorted order (equal prompts, equal keys; neighbouring keys share the most
    tokens, which the trainer then runs once) and the prompt. A prompt is the tokens before the first loss
    token."""
    prompts = []
    for s in samples:
        first = s.loss_mask.index(1) if 1 in s.loss_mask else len(s.loss_mask)
        prompts.append(tuple(s.token_ids[:first]))
    rank = {p: k for k, p in enumerate(sorted(set(prompts)))}
    return [rank[p] for p in prompts], prompts


def _with_reward(s: Sample, reward: float) -> Sample:
    from dataclasses import replace

    return replace(s, reward=reward)
