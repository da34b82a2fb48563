"""Driver-side handle on the trainer ranks: starts `trainer.num_ranks` Ray actors forming one process group.

The methods block and return plain Python: the pipeline overlaps training with rollout by running them in a
worker thread (asyncio.to_thread). Only the two sides of a weight broadcast must run concurrently, so
`broadcast_weights_async` returns rank 0's `ray.ObjectRef` instead. Calls from one
driver run in order on every rank; the other ranks' refs are kept and checked at the next call so a failure on
any rank surfaces.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import ray

from agentrl.config.schema import Config
from agentrl.models.hub import hub_env, model_ref
from agentrl.models.tiny import resolve_model_path
from agentrl.placement import create_placement
from agentrl.platform import Platform, cluster_platform, worker_env
from agentrl.types import Sample


class TrainerGroup:
    """The trainer as the pipeline sees it: `train_step`, `sft_step`, `compute_logprobs`, `export_weights`,
    `save_checkpoint` / `load_checkpoint`, `version`, `shutdown`."""

    def __init__(self, cfg: Config, model_path: str | None = None, platform: Platform | None = None) -> None:
        """`platform`: the run's (default: from cfg.platform and the Ray cluster's resources, not this node's)."""
        self.cfg = cfg
        source, revision = model_path or cfg.model.path, None if model_path else cfg.model.revision
        path = resolve_model_path(source, cfg.model.cache_dir, revision)
        self.model_path = path
        plat = platform or cluster_platform(cfg.platform)
        # a hub id reaches the ranks as one (each resolves it on its own node): a snapshot path is only the driver's
        self.ranks = self._create_ranks(cfg, model_ref(source, revision, path), plat)
        self._pending: list[ray.ObjectRef] = []
        self._version = 0  # the ranks count it too; the driver tracks it so reading it costs no round trip
        # Rank 0 hosts the rendezvous, wherever Ray placed it (multi-node safe).
        addr, port = ray.get(self.ranks[0].rendezvous_address.remote())
        ray.get([a.setup.remote(addr, port) for a in self.ranks])  # surface start-up errors here

    def _create_ranks(self, cfg: Config, path: str, plat: Platform) -> list[Any]:
        """One actor per rank, each in its bundle of one PACK placement group ({device: 1} + trainer.ray_resources),
        told the run's platform (AGENTRL_PLATFORM) so that its own `detect()` agrees. The reservation is freed when
        this group is garbage-collected (or the driver exits)."""
        from agentrl.trainer.worker import TrainerRank

        n = cfg.trainer.num_ranks
        self._placement = create_placement(plat, 1.0, cfg.trainer.ray_resources, n, name="trainer ranks")
        weakref.finalize(self, self._placement.remove)
        env = {**worker_env(plat), **plat.actor_env(), **hub_env()}
        if os.environ.get("AGENTRL_STRICT_DEVICES"):  # device-placement checks (worker.py), e.g. on a device run
            env["AGENTRL_STRICT_DEVICES"] = os.environ["AGENTRL_STRICT_DEVICES"]
        cls = ray.remote(TrainerRank)
        cfg_dict = cfg.model_dump(by_alias=True)
        return [
            cls.options(**self._placement.options(r), runtime_env={"env_vars": env}).remote(cfg_dict, path, r, n)
            for r in range(n)
        ]

    # ---- plumbing ------------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> ray.ObjectRef:
        """Call `method` on every rank; return rank 0's ref and remember the rest."""
        self._check_pending()
        refs = [getattr(a, method).remote(*args) for a in self.ranks]
        self._pending = refs[1:]
        return refs[0]

    def _check_pending(self) -> None:
        if self._pending:
            ray.get(self._pending)
            self._pending = []

    def _get(self, ref: ray.ObjectRef) -> Any:
        out = ray.get(ref)
        self._check_pending()
        return out

    # ---- the API -------------------------------------------------------------------------------------------

    def train_step(self, samples: list[Sample], report: Sequence[int] = ()) -> dict[str, Any]:
        """One RL step on this batch, which makes the next policy version; metrics
        `train/{loss,kl,entropy,clip_frac,grad_norm,lr,optimizer_steps}` and more, and the per-token advantages
        of the samples at the `report` positions (`agentrl.types.REPORTED_ADVANTAGES`)."""
        out = self._get(self._call("train_step", ray.put(samples), list(report)))
        self._version += 1
        return out

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step (cross-entropy on loss-mask tokens): a warm start, so the version stays."""
        return self._get(self._call("sft_step", ray.put(samples)))

    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-token log-probs under the current weights, aligned with token_ids (0.0 at position 0)."""
        self._check_pending()
        ref = ray.put(samples)
        merged: dict[int, list[float]] = {}
        for part in ray.get([a.compute_logprobs.remote(ref) for a in self.ranks]):
            merged.update(part)
        return [merged[i] for i in range(len(samples))]

    def export_weights(
        self, out_dir: str, dtype: str = "float32", prune_older: bool = False, part: str = "model", base: str = ""
    ) -> str:
        """Full weights as HF safetensors in `out_dir`, cast to `dtype`: an engine's reload_weights dir
        (rollout.weight_sync=disk, which prunes the older snapshots) or a cached warm start. With trainer.lora,
        `part` "base" or "adapters" writes that part alone (`WeightPublisher.export_weights`)."""
        return self._get(self._call("export_weights", out_dir, dtype, prune_older, part, base))

    def save_warm_start(self, path: str) -> bool:
        """The current weights (float32) as an HF model dir at `path`, written and renamed into place by rank 0
        on its own node; False when another run saved it first."""
        return self._get(self._call("save_warm_start", path))

    def end_warm_start(self, path: str) -> bool:
        """After the last SFT step: the weights saved as `save_warm_start` does; with trainer.lora's full warm
        start they then become the base of fresh adapters (every rank rebuilds its policy from `path`)."""
        return self._get(self._call("end_warm_start", path))

    def write_sentinel(self, path: str, dtype: str) -> None:
        """Rank 0 writes `path` after checking its folder has room for two snapshots in `dtype` (disk sync)."""
        self._get(self._call("write_sentinel", path, dtype))

    def can_read(self, path: str) -> list[bool]:
        """Per rank: whether its node sees `path`."""
        self._check_pending()
        return ray.get([a.can_read.remote(path) for a in self.ranks])

    def remove_path(self, path: str) -> None:
        """Rank 0 removes a file or folder it wrote (on its node, which may not be the driver's)."""
        self._get(self._call("remove_path", path))

    def weight_metas(self, dtype: str, part: str = "model") -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of every tensor `broadcast_weights_async` sends: what the receivers allocate."""
        return self._get(self._call("weight_metas", dtype, part))

    def sync_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port there (from `rollout.weight_sync_ports` when set): where a new
        weight-sync group meets (rank 0 hosts it, and drops the one it hosted)."""
        self._check_pending()
        return ray.get(self.ranks[0].sync_address.remote())

    def broadcast_weights_async(
        self, where: dict, dtype: str, bucket_bytes: int, delta: bool = False, part: str = "model"
    ) -> ray.ObjectRef:
        """Start sending the current weights over the weight-sync group `where` (SyncGroup fields); the engines
        must receive meanwhile, so this returns rank 0's ref (bytes sent) instead of waiting. `delta`: only what
        changed since the last sync in the same group travels (rollout.weight_sync_delta). `part`: with
        trainer.lora, "adapters" or "base+adapters" (`WeightPublisher.export_weights`)."""
        return self._call("broadcast_weights", where, dtype, bucket_bytes, delta, part)

    def save_checkpoint(self, ckpt_dir: str) -> str:
        """Sharded DCP checkpoint: model, optimizer(s), scheduler, RNG, policy version, optimizer steps."""
        return self._get(self._call("save_checkpoint", ckpt_dir))

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Restore everything `save_checkpoint` wrote; returns the restored policy version."""
        self._version = int(self._get(self._call("load_checkpoint", ckpt_dir)))
        return self._version

    @property
    def version(self) -> int:
        """Policy version = RL batches trained (the initial / warm-start weights are version 0): what engines
        stamp on tokens and what max_staleness counts in."""
        return self._version

    def shutdown(self) -> None:
        """Tear down the process group and kill the actors."""
        try:
            ray.get([a.shutdown.remote() for a in self.ranks], timeout=30)
        except Exception:
            pass
        for a in self.ranks:
            ray.kill(a)
        self.ranks = []
        self._pending = []
        self._placement.remove()
