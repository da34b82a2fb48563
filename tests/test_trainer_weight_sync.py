"""Bucketed weight broadcast: planning, packing, and a real 2-process broadcast over gloo on CPU.

The sender is the trainer's, the receiver the vLLM worker extension's. The NCCL / HCCL groups and the extension
run the same code with another backend; they are checked only on a device.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch

from agentrl.trainer.worker import TrainerRank
from agentrl.weightsync.buckets import PackBuffer, meta_of, new_group, pack_bucket, plan_buckets, unpack_bucket
from agentrl.weightsync.delta import bits, checksum
from agentrl.weightsync.receive import receive_state_dict
from agentrl.weightsync.send import broadcast_weights


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(8, 4, generator=g),
        "a.bias": torch.randn(8, generator=g),
        "b.weight": torch.randn(64, 16, generator=g),
        "c.ids": torch.arange(6, dtype=torch.int64),
        "d.weight": torch.randn(3, generator=g),
    }


def test_plan_and_pack_round_trip() -> None:
    state = _state()
    metas = [meta_of(k, v) for k, v in state.items()]
    buckets = plan_buckets(metas, bucket_bytes=256)
    assert [[m.name for m in b] for b in buckets] == [["a.weight", "a.bias"], ["b.weight"], ["c.ids"], ["d.weight"]]
    for bucket in buckets:
        flat = pack_bucket([state[m.name] for m in bucket])
        for name, t in unpack_bucket(flat, bucket):
            assert torch.equal(t, state[name])


def _receiver(port: int, queue) -> None:
    torch.set_num_threads(1)
    group = new_group("gloo", "127.0.0.1", port, 1, 2, timeout_s=60)
    metas = [meta_of(k, v) for k, v in _state().items()]
    got = dict(receive_state_dict(group, metas, torch.device("cpu"), bucket_bytes=256))
    # numpy arrays travel by value: a torch tensor would travel as a shared-memory handle, which this process,
    # exiting once it has put, may take with it before the test reads it
    queue.put({k: v.numpy() for k, v in got.items()})


def test_broadcast_over_gloo_between_processes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, queue), daemon=True)
    proc.start()
    try:
        group = new_group("gloo", "127.0.0.1", port, 0, 2, timeout_s=60)
        named = list(_state().items())
        metas = [meta_of(k, v) for k, v in named]
        sent = broadcast_weights(group, named, metas, bucket_bytes=256, buffer=PackBuffer())  # one buffer, 4 buckets
        assert sent == sum(v.numel() * v.element_size() for _, v in named)
        got = queue.get(timeout=60)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    expected = _state()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(torch.from_numpy(got[k]), expected[k])


def test_disk_sync_refuses_a_weights_dir_without_room_for_two_snapshots(tmp_path, monkeypatch):
    """A container's default 64 MB /dev/shm is a folder, so an is_dir check passes and the first export fails
    mid-run: the start-up sentinel also checks the free space. The free space is faked (shutil.disk_usage) since
    no small filesystem can be mounted here; the rank is the real method on a stand-in holding a real model."""
    model = torch.nn.Linear(1024, 1024)  # ~1M params: two fp32 snapshots ~8 MiB
    backend = SimpleNamespace(weight_metas=lambda m, tied: [(k, v.shape, v.dtype) for k, v in m.state_dict().items()])
    rank = SimpleNamespace(rank=0, model=model, tied=False, backend=backend)
    sentinel = tmp_path / "w" / ".sentinel"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=64 << 10))
    with pytest.raises(RuntimeError, match=r"MiB free and two weight snapshots need 8 MiB"):
        TrainerRank.write_sentinel(rank, str(sentinel), "float32")
    assert not sentinel.exists()
    monkeypatch.setattr(shutil, "disk_usage", real)
    TrainerRank.write_sentinel(rank, str(sentinel), "bfloat16")
    assert sentinel.exists()


def test_the_sync_store_listens_on_a_port_of_rollout_weight_sync_ports():
    """Cross-node, the engines' nodes must reach the weight-sync group's store on trainer rank 0's node: it binds a
    port of `rollout.weight_sync_ports` (the first free one), dropping the group it hosted first, so a range of one
    port serves every sync; a range with no free port fails naming the key. The rank is the real method on a
    stand-in."""
    from agentrl.config import load_config
    from agentrl.weightsync.buckets import GroupCache, SyncError, SyncGroup
    from tests.servers import free_port

    base = free_port()
    with socket.socket() as busy:  # someone else's listener on the first port of the range
        busy.bind(("", base))
        busy.listen()
        cfg = load_config(None, [f"rollout.weight_sync_ports={base}-{base + 2}"])
        rank = SimpleNamespace(cfg=cfg, _sync_groups=GroupCache())
        addr, port = TrainerRank.sync_address(rank)
        assert base < port <= base + 2
        rank._sync_groups.get(SyncGroup(addr, port, 1, "gloo", 10.0), rank=0)  # what broadcast_weights does
        socket.create_connection((addr, port), timeout=5).close()  # the store listens there
        assert TrainerRank.sync_address(rank) == (addr, port)  # the same port again: the old group is gone
        rank.cfg = load_config(None, [f"rollout.weight_sync_ports={base}"])
        with pytest.raises(SyncError, match=rf"rollout.weight_sync_ports: no free port in {base}-{base}"):
            TrainerRank.sync_address(rank)


# ---- delta sync (rollout.weight_sync_delta) --------------------------------------------------------------------

DELTA_SYNCS = 5
DRIFT_AT = 3  # before this sync, receiver 2 corrupts one element of its base of the b.weight bucket


def _bf16_metas() -> list:
    return [meta_of(k, v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _state().items()]


def _delta_receiver(port: int, rank: int, queue) -> None:
    torch.set_num_threads(1)
    group = new_group("gloo", "127.0.0.1", port, rank, 3, timeout_s=60)
    bases: dict[int, torch.Tensor] = {}
    for sync in range(DELTA_SYNCS):
        if rank == 2 and sync == DRIFT_AT:
            bits(bases[1])[5] ^= 1  # a flipped low bit in a position the next delta leaves alone
        got = receive_state_dict(group, _bf16_metas(), torch.device("cpu"), bucket_bytes=256, bases=bases)
        queue.put((rank, sync, {k: bits(v).numpy().copy() for k, v in got}))


def _step(state: dict[str, torch.Tensor], sync: int) -> None:
    """What a training step does to the bf16 weights: 3% of the elements move (15% at sync 3, all of a.weight and
    a.bias at sync 2, none at sync 4)."""
    if sync == 4:
        return
    g = torch.Generator().manual_seed(sync)
    for name, t in state.items():
        if t.is_floating_point():
            fraction = 1.0 if (name[0], sync) == ("a", 2) else 0.15 if sync == 3 else 0.03
            moved = torch.rand(t.shape, generator=g) < fraction
            if name == "b.weight":
                moved.view(-1)[5] = False
            t[moved] = t[moved] * 1.5 + 0.25


def test_delta_sync_delivers_what_a_full_sync_does_and_repairs_a_drifted_base() -> None:
    """Two receivers (engine workers) over gloo, bf16 weights: the first sync is full, later ones carry only the
    changed elements, as positions or as a bitmask (or the whole bucket, whichever is smallest), every received
    weight equals the sender's bit for bit; a receiver whose base drifted is caught by the checksum and the bucket
    is sent again in full, to both receivers."""
    port = free_port_local()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_delta_receiver, args=(port, r, queue), daemon=True) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        group = new_group("gloo", "127.0.0.1", port, 0, 3, timeout_s=60)
        state, metas, bases, buffer = _state(), _bf16_metas(), {}, PackBuffer()
        full_bytes = sum(m.numel * torch.empty((), dtype=m.torch_dtype).element_size() for m in metas)
        sent, expected = [], []
        for sync in range(DELTA_SYNCS):
            if sync:
                _step(state, sync)
            sent.append(broadcast_weights(group, list(state.items()), metas, 256, buffer, 60, bases))
            expected.append({k: bits(v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()})
        got = [queue.get(timeout=60) for _ in range(2 * DELTA_SYNCS)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert len(got) == 2 * DELTA_SYNCS
    for rank, sync, tensors in got:
        assert tensors.keys() == expected[sync].keys()
        for k, v in tensors.items():
            assert torch.equal(torch.from_numpy(v), expected[sync][k]), (rank, sync, k)
    buckets = plan_buckets(metas, 256)
    headers = 8 * 3 * len(buckets)
    assert sent[0] == full_bytes + headers  # no base yet: every bucket in full
    forms_used = set()
    for sync in range(1, DELTA_SYNCS):  # per bucket: int32 index + value of each changed element, or all of it
        moved, sizes = [], []
        for b in buckets:
            k = sum(int((expected[sync][m.name] != expected[sync - 1][m.name]).sum()) for m in b)
            n, e = sum(m.numel for m in b), expected[sync][b[0].name].element_size()
            sizes.append(n * e)
            forms = {"positions": k * (4 + e), "bitmask": -(-n // 8) + k * e}
            form = min(forms, key=forms.__getitem__)
            form = form if forms[form] <= n * e // 2 else "whole"  # a delta only when it halves the bucket
            moved.append(n * e if form == "whole" else forms[form])
            forms_used.add(form)
        repaired = sizes[1] if sync == DRIFT_AT else 0  # receiver 2's b.weight disagreed: sent again in full
        assert sent[sync] == headers + sum(moved) + repaired, sync
        if sync == 2:
            assert moved[0] == sizes[0]  # a.* moved whole: their bucket's changes cost more than it, sent whole
    assert forms_used == {"whole", "positions", "bitmask"}
    assert headers < sent[1] < full_bytes / 4  # ~3% of the elements moved
    assert sent[4] == headers  # nothing moved: headers only


def free_port_local() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_checksum_sees_one_flipped_bit_and_not_the_order_of_sums() -> None:
    t = torch.randn(1000).to(torch.bfloat16)
    flipped = t.clone()
    bits(flipped)[123] ^= 1 << 3
    assert checksum(t) == checksum(t.clone()) != checksum(flipped)
    assert checksum(torch.tensor([-0.0])) != checksum(torch.tensor([0.0]))


def test_delta_sync_needs_the_collective_sync():
    from agentrl.config import ConfigError, load_config

    assert load_config(None, ["rollout.weight_sync_delta=true"]).rollout.weight_sync_delta
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync_delta needs the collective weight sync"):
        load_config(None, ["rollout.weight_sync_delta=true", "rollout.weight_sync=disk"])


class FakeNPU:
    """Stand-in for `torch.npu` (torch_npu's module): no NPU exists on this machine. It records what the code
    under test asks of the device into `log`; its streams and events complete when `done` says so."""

    def __init__(self, log: list[str], done: bool = True) -> None:
        self.log, self.done = log, done
        npu = self

        class Stream:
            def wait_stream(self, other) -> None:
                npu.log.append("stream waits for the current one")

        class Event:
            def record(self, stream) -> None:
                npu.log.append("event recorded")

            def query(self) -> bool:
                return npu.done

        self.Stream, self.Event = Stream, Event
        self._current = Stream()

    def current_stream(self):
        return self._current

    def current_device(self) -> int:
        return 3

    def synchronize(self) -> None:
        self.log.append("npu synchronized")


class FakeTorch:
    """`torch` as the worker extension sees it on an NPU, stood in on CPU: `torch.npu` is a FakeNPU and
    `torch.device(d)` a context that logs its entry and exit (torch.device("npu") needs torch_npu); the rest is
    the real torch."""

    def __init__(self, npu: FakeNPU) -> None:
        self.npu = npu

    def device(self, device):
        import contextlib

        @contextlib.contextmanager
        def as_default():
            self.npu.log.append(f"default device {device.type}:{device.index}")
            yield
            self.npu.log.append("default device restored")

        return as_default()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _npu_worker(monkeypatch, log: list[str]):
    """An AgentrlWorkerExtension as vllm-ascend's NPUWorker would mix it in (its `device` is npu:0), with a model
    runner whose in-place reload logs when the weights load."""
    from agentrl.rollout import vllm_worker

    monkeypatch.setattr(vllm_worker, "torch", FakeTorch(FakeNPU(log)))

    class Runner:
        model = torch.nn.Linear(2, 2)

        def reload_weights(self, weights_iterator=None, weights_path=None) -> None:
            n = sum(1 for _ in weights_iterator) if weights_iterator is not None else weights_path
            log.append(f"weights loaded: {n}")

    worker = vllm_worker.AgentrlWorkerExtension()
    worker.model_runner, worker.device, worker.rank = Runner(), SimpleNamespace(type="npu", index=0), 0
    return worker


@pytest.mark.parametrize("path", ["disk", "collective"])
def test_npu_reload_runs_under_the_device_then_synchronizes_simulated(monkeypatch, path) -> None:
    """FakeNPU: the reload runs as vllm-ascend v0.23.0's NPUWorker.update_weights does its own: under the worker's
    device as the default device, then torch.npu.synchronize(); and only with VLLM_ASCEND_ENABLE_NZ=0. The
    collective path receives over a one-process gloo group (the buckets arrive inside the device context)."""
    log: list[str] = []
    worker = _npu_worker(monkeypatch, log)
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    if path == "disk":
        worker.reload_from_path("/snap/v1")
        loaded = "weights loaded: /snap/v1"
    else:
        from agentrl.rollout import vllm_worker

        def on_cpu(pg, wanted, device, *args):  # the FakeNPU device holds no tensors: they are received on CPU
            for name, tensor in receive_state_dict(pg, wanted, torch.device("cpu"), *args):
                log.append(f"received {name} on {device.type}")
                yield name, tensor

        monkeypatch.setattr(vllm_worker, "receive_state_dict", on_cpu)
        group = {"addr": "127.0.0.1", "port": free_port_local(), "world_size": 1, "backend": "gloo", "timeout_s": 30}
        metas = [("a.weight", (8, 4), "float32"), ("b.weight", (3,), "float32")]
        assert worker.receive_weights(group, 0, metas, bucket_bytes=64) == 2
        worker._agentrl_groups.close()
        loaded = "weights loaded: 2"
        assert log[1:3] == ["received a.weight on npu", "received b.weight on npu"]  # inside the device context
        del log[1:3]
    assert log == ["default device npu:0", loaded, "default device restored", "npu synchronized"]

    for refused in ("1", None):  # vllm-ascend's default is 1
        if refused is None:
            monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ")
        else:
            monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", refused)
        log.clear()
        with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ=0"):
            worker.reload_from_path("/snap/v2")
        assert log == []


def test_hccl_group_is_vllm_ascends_stateless_pyhccl_communicator_simulated(monkeypatch) -> None:
    """FakeNPU and a stand-in PyHcclCommunicator (no NPU, no vllm-ascend here): new_group("hccl") builds what
    vllm-ascend v0.23.0's HCCLWeightTransferEngine._stateless_init_process_group builds (vLLM's real
    StatelessProcessGroup, then PyHcclCommunicator on the current NPU), issues collectives on a stream of its own
    after the current one, copies an all-reduce's result back, and fails a collective that never completes after
    the group's timeout (SyncError) instead of hanging."""
    import sys
    import types

    from agentrl.weightsync.buckets import HcclGroup, SyncError, wait

    log: list[str] = []
    npu = FakeNPU(log)

    class StandInPyHcclCommunicator:
        """Stand-in for vllm_ascend.distributed.device_communicators.pyhccl.PyHcclCommunicator."""

        disabled = False

        def __init__(self, group, device) -> None:
            log.append(f"communicator rank {group.rank}/{group.world_size} on npu {device}")

        def broadcast(self, tensor, src, stream=None) -> None:
            log.append(f"broadcast from {src} on the group's stream: {stream is not npu.current_stream()}")

        def all_reduce(self, tensor, stream=None):
            log.append("all_reduce")
            return tensor * 2

    pyhccl = types.ModuleType("vllm_ascend.distributed.device_communicators.pyhccl")
    pyhccl.PyHcclCommunicator = StandInPyHcclCommunicator
    for name in ("vllm_ascend", "vllm_ascend.distributed", "vllm_ascend.distributed.device_communicators"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, pyhccl.__name__, pyhccl)
    monkeypatch.setattr(torch, "npu", npu, raising=False)

    group = new_group("hccl", "127.0.0.1", free_port_local(), 0, 1, timeout_s=30)
    assert isinstance(group, HcclGroup)
    flat = torch.zeros(4)
    wait(group.broadcast(flat, 0), 5)
    flags = torch.tensor([0, 1])
    wait(group.allreduce(flags), 5)
    assert flags.tolist() == [0, 2]
    assert log == [
        "communicator rank 0/1 on npu 3",
        "stream waits for the current one",
        "broadcast from 0 on the group's stream: True",
        "event recorded",
        "stream waits for the current one",
        "all_reduce",
        "event recorded",
    ]
    npu.done = False  # a peer died: the collective never completes on the device
    with pytest.raises(SyncError, match=r"not done after 0\.2 s"):
        wait(group.broadcast(flat, 0), 0.2)
    group.abort()
