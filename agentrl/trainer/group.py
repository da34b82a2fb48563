"""Driver-side handle on the trainer ranks: starts `trainer.num_ranks` Ray actors forming one process group.

The methods block and return plain Python: the pipeline overlaps training with rollout by running them in a
worker thread (asyncio.to_thread). Only the two sides of a weight broadcast must run concurrently, so
`init_weight_group_async` / `broadcast_weights_async` return rank 0's `ray.ObjectRef` instead. Calls from one
driver run in order on every rank; the other ranks' refs are kept and checked at the next call so a failure on
any rank surfaces.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from agentrl.config.schema import Config
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import detect, worker_env
from agentrl.types import Sample


class TrainerGroup:
    """The trainer as the pipeline sees it: `train_step`, `sft_step`, `compute_logprobs`, `export_weights`,
    `save_checkpoint` / `load_checkpoint`, `version`, `shutdown`."""

    def __init__(self, cfg: Config, model_path: str | None = None) -> None:
        from agentrl.trainer.worker import TrainerRank

        self.cfg = cfg
        path = resolve_model_path(model_path or cfg.model.path, cfg.model.cache_dir)
        self.model_path = path
        n = cfg.trainer.num_ranks
        plat = detect()
        opts = plat.ray_actor_options(1.0)
        env = {**worker_env(), **({"AGENTRL_PLATFORM": plat.kind} if plat.kind == "cpu" else {})}
        if os.environ.get("AGENTRL_STRICT_DEVICES"):  # device-placement checks (worker.py), e.g. on a device run
            env["AGENTRL_STRICT_DEVICES"] = os.environ["AGENTRL_STRICT_DEVICES"]
        cls = ray.remote(TrainerRank).options(**opts, runtime_env={"env_vars": env})
        cfg_dict = cfg.model_dump(by_alias=True)
        self.ranks = [cls.remote(cfg_dict, path, r, n) for r in range(n)]
        self._pending: list[ray.ObjectRef] = []
        self._version = 0  # the ranks count it too; the driver tracks it so reading it costs no round trip
        # Rank 0 hosts the rendezvous, wherever Ray placed it (multi-node safe).
        addr, port = ray.get(self.ranks[0].rendezvous_address.remote())
        ray.get([a.setup.remote(addr, port) for a in self.ranks])  # surface start-up errors here

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

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on this batch, which makes the next policy version; metrics
        `train/{loss,kl,entropy,clip_frac,grad_norm,lr,optimizer_steps}` and more."""
        out = self._get(self._call("train_step", ray.put(samples)))
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

    def export_weights(self, out_dir: str) -> str:
        """Full weights as HF safetensors in `out_dir` (/dev/shm on CPU): an engine's reload_weights dir."""
        return self._get(self._call("export_weights", out_dir))

    def weight_metas(self) -> list:
        """Names, shapes, dtypes of the weights that `broadcast_weights_async` sends (for the receivers)."""
        return self._get(self._call("weight_metas"))

    def init_weight_group_async(self, addr: str, port: int, world_size: int) -> ray.ObjectRef:
        """Rank 0 joins a broadcast group with the engine workers; start both sides together. Not called by the
        pipeline (engines reload `export_weights` snapshots): the collective path the multi-node work will wire."""
        return self._call("init_weight_group", addr, port, world_size)

    def broadcast_weights_async(self, bucket_bytes: int = 256 << 20) -> ray.ObjectRef:
        """Broadcast the current weights to the engines (who call `receive_weights` meanwhile). Not called by the
        pipeline yet: the collective path the multi-node work will wire."""
        return self._call("broadcast_weights", bucket_bytes)

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
