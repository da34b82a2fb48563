"""One trainer rank (a Ray actor): FSDP2 policy (+ reference, + critic), RL and SFT steps, export, checkpoint.

Every rank receives the whole batch (one ray.put by the driver), computes the sequence-level advantages and
the global loss denominators for all of it (cheap and identical everywhere), then works on its token-balanced
shard. Each micro-batch's loss is divided by the *global* denominator (its share of the global loss; the backend
sums the shares' gradients over micro-batches and ranks), so 1 rank and N ranks take the same optimizer step up to
float rounding.

The rank coordinates; the pieces are elsewhere: the batch's advantages, mini-batches and metric summary are pure
functions (`rl_batch`), each micro-batch's loss is assembled in `loss_terms`, and the rule of where tensors live and
how bookkeeping crosses ranks is `collectives`'. The default group is "cpu:gloo,<device>:<nccl|hccl>"
(`Platform.process_group_backend`): everything that enters the model or a loss is on `self.device` (each collated
micro-batch is moved there once), and metric sums stay there until one device-to-host copy at the end of a step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from agentrl.config.schema import Config
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import configure_cpu_threads, detect
from agentrl.trainer import loss_terms, losses
from agentrl.trainer.backends import ModelBackend, TrainOptimizer, create_backend
from agentrl.trainer.batching import (
    LazyMicroBatches,
    collate,
    micro_batches,
    scatter_back,
    shard_indices,
    to_device,
)
from agentrl.trainer.checkpoint import copy_hf_side_files, rng_state, set_rng_state
from agentrl.trainer.collectives import RankSums, check_device, compute_tensors, gather_dicts, host_all_reduce
from agentrl.trainer.loss_terms import RL_SUMS
from agentrl.trainer.model import runs_varlen
from agentrl.trainer.rl_batch import (
    RLBatch,
    episode_token_weights,
    mini_batch_parts,
    prompts_of,
    shaped_advantages,
    step_summary,
)
from agentrl.trainer.warm_start import WarmStartSteps
from agentrl.trainer.weight_publish import WeightPublisher
from agentrl.types import REPORTED_ADVANTAGES, Sample
from agentrl.weightsync.buckets import GroupCache, PackBuffer


class TrainerRank(WarmStartSteps, WeightPublisher):
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
        self.base_path = os.path.abspath(model_path)  # the dir of the policy's base weights (LoRA: frozen in RL)
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
        then counts a prompt once, not once per row). `prompts`: `prompts_of(samples)`, when the step has it."""
        lengths = [len(s.token_ids) for s in samples]
        if mine is None:
            mine = shard_indices(lengths, self.backend.dp_size)[self.backend.dp_rank]
        keys, tokens = prompts or prompts_of(samples)
        shares = shared and self.tc.packing == "pad"
        mbs = micro_batches(
            mine, lengths, self.tc.micro_batch_tokens, self.tc.packing, keys, tokens if shares else None
        )
        n = host_all_reduce(torch.tensor([len(mbs)]), dist.ReduceOp.MAX)
        return mbs + [[] for _ in range(max(int(n), 1) - len(mbs))]

    def _shares_prompts(self, grad: bool) -> bool:
        """Whether every model pass over a plan's micro-batches runs repeated prompts once: the critic's value
        pass reuses the policy's plan and runs every row whole."""
        return self.critic is None and self.backend.shares_prompts(self.model, grad)

    def _batch(self, samples: list[Sample], idx: list[int], fields: dict[str, dict[int, list[float]]]) -> dict:
        """Collate micro-batch `idx` onto the rank's device; an empty one is a 2-token dummy, loss mask 0 (keeps
        FSDP in step)."""
        layout, block_mask = self.tc.packing, not runs_varlen(self.model)
        if not idx:
            batch = collate([[self.pad_id] * 2], {k: [[0.0, 0.0]] for k in fields}, layout, self.pad_id, block_mask)
        else:
            toks = [samples[i].token_ids for i in idx]
            batch = collate(toks, {k: [v[i] for i in idx] for k, v in fields.items()}, layout, self.pad_id, block_mask)
        batch = to_device(batch, self.device)
        check_device(compute_tensors(batch), self.device, "collated micro-batch")
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
        return gather_dicts(local, self.backend.dp_group)

    def _denom(self, rl: RLBatch, part: list[int]) -> float:
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
        return float(host_all_reduce(torch.tensor([local], dtype=torch.float64), group=self.backend.dp_group))

    def _mini_batches(self, samples: list[Sample], mine: list[int]) -> list[list[int]]:
        """This rank's mini-batches of whole groups, shuffled anew each step (seeded by the policy version)."""
        seed = self.cfg.seed * 100_003 + self.version * 1009 + self.backend.dp_rank
        return mini_batch_parts(samples, mine, self.alg.mini_batches, seed)

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
        summary = step_summary(self.alg, rl, sums, grad_norms, lrs, time.perf_counter() - t0, self.critic is not None)
        out: dict[str, Any] = {**summary, **gap}
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
        summed = host_all_reduce(torch.tensor([total, count], dtype=torch.float64), group=self.backend.dp_group)
        return {"train/rollout_logprob_diff": float(summed[0] / summed[1])} if summed[1] else {}

    def _prepare(self, samples: list[Sample]) -> RLBatch:
        """Under the weights from before this step: the micro-batch plan, the proximal / reference log-probs
        and values, advantages, and every per-token input of the loss."""
        alg = self.alg
        prompts = prompts_of(samples)
        mbs = self._plan(samples, shared=self._shares_prompts(grad=False), prompts=prompts)
        mine = [i for mb in mbs for i in mb]
        self.model.eval()
        prox = self._logprob_pass(self.model, samples, mbs) if alg.loss == "decoupled_ppo" else None
        ref = self._logprob_pass(self.ref, samples, mbs) if self.ref is not None else None
        values = self._value_pass(samples, mbs) if self.critic is not None else None
        advs, returns, _ = shaped_advantages(self.alg, samples, mine, prox, ref, values, self._gather)
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
        episode_w = episode_token_weights(samples, model_tokens) if alg.loss_agg == "episode_mean" else None
        if episode_w is not None:
            fields["token_weight"] = {i: [episode_w[i]] * len(samples[i].token_ids) for i in mine}
        return RLBatch(samples, mine, fields, model_tokens, episode_w, prompts, self._without_gradient(mine, advs))

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

    def _optimize(self, rl: RLBatch) -> tuple[dict[str, float], list[float], list[float]]:
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
                    value_loss = partial(loss_terms.value_loss, self.alg, denom=denom)
                    values = self.backend.forward_backward(self.critic, batches, value_loss)
                    rows = [{**r, **v} for r, v in zip(rows, values, strict=True)]
                for row in rows:
                    sums.add(row)
                lrs.append(self.opt.lr)
                grad_norms.append(self.opt.step())
                if self.critic is not None:
                    self.critic_opt.step()
        return sums.all_reduce(), grad_norms, lrs

    def _rl_loss(self, batch: dict, logp: torch.Tensor, ent: torch.Tensor | None, denom: float):
        return loss_terms.rl_loss(self.alg, self.device, batch, logp, ent, denom)

    def compute_logprobs(self, samples: list[Sample]) -> dict[int, list[float]]:
        """This rank's share of the batch's log-probs under the current weights, of the distribution the engines
        sample from (merged by the driver)."""
        self.model.eval()
        return self._logprob_pass(self.model, samples, self._plan(samples), every_token=True)

    # ---- weights and state ---------------------------------------------------------------------------------

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
                    "backend": self.tc.backend, "optimizers": sorted(self._optimizers()),
                    "lora": self.tc.lora.model_dump() if self.tc.lora else None,
                    "lora_base": self.base_path if self.tc.lora else None}  # fmt: skip
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
        lora = self.tc.lora.model_dump() if self.tc.lora else None
        if meta.get("lora") != lora:
            raise ValueError(f"{ckpt_dir} was saved with trainer.lora={meta.get('lora')}, this run has {lora}")
        if lora is not None and meta.get("lora_base") and meta["lora_base"] != self.base_path:
            self._rebase(meta["lora_base"])  # a full warm start's base: the checkpoint holds the adapters only
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
