"""An engine that dies or hangs in the middle of a collective weight sync fails that sync, not the trainer.

Real pieces: two FSDP2 trainer ranks (Ray actors, gloo) whose rank 0 broadcasts, and an engine stand-in in its
own process running the engine workers' receiving code (`receive_state_dict`) in the weight-sync group. The
stand-in dies (SIGKILL: gloo sees the connection reset at once) or hangs (SIGSTOP: what a dead peer looks like
to NCCL / HCCL, which see nothing until the group's timeout) after a third of the weights. The model is ~50 MB,
more than the sockets buffer, so the sender is still sending when the receiver goes. Every group meets on the
one port `rollout.weight_sync_ports` names (rank 0 drops the group it hosts before the next one binds it).

Before the fix, rank 0 raised out of the middle of the walk over the weights while rank 1 went on to the next
all-gather and waited there for the default group's timeout (30 minutes): the trainer was wedged.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict

import pytest
import torch

from agentrl.config import load_config
from agentrl.models.tiny import TinySpec, build_tiny_model
from agentrl.trainer import TrainerGroup
from agentrl.types import Sample
from agentrl.weightsync.buckets import SyncGroup, TensorMeta, new_group
from agentrl.weightsync.receive import receive_state_dict
from tests.servers import free_port

TIMEOUT_S = 5.0  # rollout.weight_sync_timeout_s: the weight-sync group's own timeout
BUCKET_BYTES = 1 << 20
SPEC = TinySpec(layers=4, hidden=512, intermediate=1536, heads=8, kv_heads=4)  # ~13M params, ~52 MB in fp32


def _engine(addr: str, port: int, metas: list, fate: str, queue) -> None:
    """An engine worker's receiving end, rank 1 of the weight-sync group. fate: "ok" (sends back what it got),
    "killed" (SIGKILLs itself a third of the way in) or "hung" (SIGSTOPs itself there)."""
    torch.set_num_threads(1)
    wanted = [TensorMeta(name, tuple(shape), dtype) for name, shape, dtype in metas]
    queue.put("ready")  # imported (a spawned process's imports take seconds): the sync may start
    group = new_group("gloo", addr, port, 1, 2, TIMEOUT_S)
    got = {}
    for name, t in receive_state_dict(group, wanted, torch.device("cpu"), BUCKET_BYTES):
        got[name] = t.clone()
        if fate != "ok" and len(got) >= len(wanted) // 3:
            queue.put(fate)
            queue.close()
            queue.join_thread()  # flushed before the process goes
            os.kill(os.getpid(), signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
    queue.put({k: v.numpy() for k, v in got.items()})  # numpy travels by value (see test_trainer_weight_sync)


PORT = free_port()  # rollout.weight_sync_ports: a range of one


@pytest.fixture(scope="module")
def trainer(ray_session, tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("model"), SPEC)
    sync = [f"rollout.weight_sync_timeout_s={TIMEOUT_S}", f"rollout.weight_sync_ports={PORT}"]
    group = TrainerGroup(load_config(None, ["trainer.num_ranks=2", *sync, "name=sync-faults"]), str(model))
    yield group
    group.shutdown()


class Engine:
    """One engine stand-in process and the sync that sends to it."""

    def __init__(self, trainer: TrainerGroup, fate: str) -> None:
        metas = trainer.weight_metas("float32")
        addr, port = trainer.sync_address()
        assert port == PORT
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.proc = ctx.Process(target=_engine, args=(addr, port, metas, fate, self.queue), daemon=True)
        self.proc.start()
        # The group's timeout covers the join and the transfer, as for an engine that is up: not this process's
        # start, which took more than TIMEOUT_S on a loaded 2-core machine (the join then timed out, 1/2 clients).
        assert self.queue.get(timeout=120) == "ready"
        where = asdict(SyncGroup(addr, port, 2, "gloo", TIMEOUT_S))
        self.started = time.monotonic()
        self.sent = trainer.broadcast_weights_async(where, "float32", BUCKET_BYTES)

    def received(self) -> dict[str, torch.Tensor]:
        got = self.queue.get(timeout=120)
        self.proc.join(timeout=30)
        return {k: torch.from_numpy(v) for k, v in got.items()}

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # a stopped process dies too
        self.proc.join(timeout=30)


def _ranks_respond(trainer: TrainerGroup) -> None:
    """Every rank takes a call within a minute (an actor still stuck in the broadcast's gathers takes none),
    and a collective forward on both ranks completes."""
    import ray

    ray.get([rank.weight_metas.remote("float32") for rank in trainer.ranks], timeout=60)
    probe = Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, [-1] * 4, reward=0.0, group_id="p", episode_id="p")
    (logprobs,) = trainer.compute_logprobs([probe])
    assert len(logprobs) == 4


@pytest.mark.parametrize("fate", ["killed", "hung"])
def test_an_engine_dying_mid_broadcast_fails_the_sync_and_the_trainer_lives_on(trainer, fate):
    import ray

    healthy = Engine(trainer, "ok")
    ray.get(healthy.sent, timeout=120)
    reference = healthy.received()
    assert len(reference) == len(trainer.weight_metas("float32"))

    dying = Engine(trainer, fate)
    try:
        assert dying.queue.get(timeout=120) == fate  # it is going: the sender is past a third of the weights
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            ray.get(dying.sent, timeout=TIMEOUT_S + 120)
        elapsed = time.monotonic() - dying.started
        _ranks_respond(trainer)  # the other rank finished its gathers: the trainer is in step and alive
    finally:
        dying.kill()
    message = str(failed.value)
    assert "SyncError: weight broadcast to the engines failed at bucket" in message, message[-2000:]
    # killed: gloo sees the reset at once; hung: the bucket's wait gives up after the group's timeout
    assert elapsed < TIMEOUT_S + 15, elapsed
    print(f"{fate}: sync failed after {elapsed:.1f} s: {message.strip().splitlines()[-1][:300]}")

    restarted = Engine(trainer, "ok")  # a later sync to a restarted engine, on a new group
    ray.get(restarted.sent, timeout=120)
    got = restarted.received()
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in reference)
