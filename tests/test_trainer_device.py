"""Device placement of a trainer rank, checked on CPU: CUDA / NPU are simulated (test names say so).

- the default group's backend string has a CPU (gloo) backend beside NCCL / HCCL, and torch parses it;
- every tensor entering the model or a loss is on the rank's device: the rank's device is set to `meta` (a device
  other than the CPU collate builds on), with STRICT_DEVICES on, so one missing `.to(device)` raises;
- bookkeeping collectives run on CPU tensors over the group's gloo backend (a real 1-rank step, in-process);
- the device RNG state goes through save_checkpoint / load_checkpoint (a fake torch.cuda RNG).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from agentrl import platform as plat
from agentrl.config.schema import Config
from agentrl.trainer import checkpoint as ckpt
from agentrl.trainer import collectives as C
from agentrl.trainer import worker as W
from agentrl.trainer.batching import LAYOUT_KEYS
from agentrl.trainer.loss_terms import RL_SUMS
from agentrl.types import Sample
from tests.servers import free_port

# ---- (a) the process group's backend string --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected", "device_map"),
    [
        ("cpu", "gloo", {"cpu": "gloo"}),
        ("cuda", "cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("npu", "cpu:gloo,npu:hccl", {"cpu": "gloo", "npu": "hccl"}),
    ],
)
def test_process_group_backend_has_a_cpu_backend_simulated(kind, expected, device_map) -> None:
    """Simulated CUDA / NPU platforms: the string init_process_group gets, as torch 2.13 parses it."""
    p = plat.platform_for(kind, 1)
    assert p.process_group_backend == expected
    parsed = BackendConfig(Backend(p.process_group_backend)).get_device_backend_map()
    assert {d: parsed[d] for d in device_map} == device_map
    assert p.dist_backend == device_map.get(kind, "gloo")  # the weight-sync group still gets the bare name


def test_device_backend_string_inits_a_real_gloo_group() -> None:
    """A "device:backend" string (the CPU half of the accelerator strings) makes a working group here."""
    assert not dist.is_initialized()
    dist.init_process_group("cpu:gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.get_backend_config() == "cpu:gloo"
        t = torch.tensor([2.0], dtype=torch.float64)
        C.host_all_reduce(t)  # the bookkeeping collective, strict or not
        assert t.item() == 2.0
        parts: list = [None]
        dist.all_gather_object(parts, {"a": 1})
        assert parts == [{"a": 1}]
    finally:
        dist.destroy_process_group()


# ---- (b) device strictness ---------------------------------------------------------------------------------


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setattr(C, "STRICT_DEVICES", True)


def _samples(n: int = 6, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, prompt = rng.randint(10, 24), rng.randint(3, 6)
        toks = [rng.randint(3, 300) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        logp = [-rng.uniform(0.5, 3.0) * m for m in mask]
        out.append(Sample(toks, mask, logp, [0] * length, float(i % 3), f"g{i // 3}", f"e{i}"))
    return out


def _shell(device: torch.device, cfg: Config | None = None) -> W.TrainerRank:
    """A rank without a process group or weights: enough for the batch plumbing and one micro-step."""
    rank = W.TrainerRank.__new__(W.TrainerRank)
    rank.cfg = cfg or Config()
    rank.tc, rank.alg = rank.cfg.trainer, rank.cfg.trainer.algorithm
    rank.rank, rank.world, rank.device, rank.pad_id = 0, 1, device, 0
    rank.model, rank.critic = object(), None
    rank.backend = SimpleNamespace(dp_rank=0, dp_size=1, dp_group=None)  # one replica; tests set its forward
    return rank


@pytest.mark.parametrize("layout", ["pad", "packed"])
def test_collated_micro_batch_lands_on_the_rank_device_simulated(strict, layout) -> None:
    """The rank's device is `meta` (standing in for cuda/npu): compute tensors of real and dummy micro-batches
    are there, the layout keys stay on the host."""
    cfg = Config()
    cfg.trainer.packing = layout
    rank = _shell(torch.device("meta"), cfg)
    samples = _samples()
    fields = {"loss_mask": {i: s.loss_mask for i, s in enumerate(samples)}}
    for idx in ([0, 2, 3], []):
        batch = rank._batch(samples, idx, fields)
        assert {k: v.device.type for k, v in batch.items() if k not in LAYOUT_KEYS} == dict.fromkeys(
            [k for k in batch if k not in LAYOUT_KEYS], "meta"
        )
        assert all(batch[k].device.type == "cpu" for k in LAYOUT_KEYS)


def test_strict_check_names_a_tensor_on_another_device(strict) -> None:
    with pytest.raises(RuntimeError, match=r"loss inputs: .* on cpu, expected meta"):
        C.check_device([torch.zeros(2, device="meta"), torch.zeros(2)], torch.device("meta"), "loss inputs")


@pytest.mark.parametrize(("loss", "kl_coef", "entropy_coef"), [("ppo_clip", 0.0, 0.0), ("decoupled_ppo", 0.05, 0.01)])
def test_rl_loss_keeps_every_loss_tensor_on_the_rank_device_simulated(
    strict, monkeypatch, loss, kl_coef, entropy_coef
) -> None:
    """The RL loss of one micro-batch with the rank's device `meta` (simulated accelerator) and a fake forward
    that asserts its inputs are there: the losses, the backward and the returned sums must all stay there."""
    cfg = Config()
    alg = cfg.trainer.algorithm
    alg.loss, alg.kl_coef, alg.entropy_coef = loss, kl_coef, entropy_coef
    rank = _shell(torch.device("meta"), cfg)
    seen = []

    def fake_forward(batch, with_entropy=False, entropy_grad=True):
        bad = {k: v.device for k, v in batch.items() if k not in LAYOUT_KEYS and v.device != rank.device}
        assert not bad, f"forward got tensors off the rank's device: {bad}"
        seen.append(batch["input_ids"].shape)
        logp = torch.full(batch["input_ids"].shape, -1.0, device=rank.device, requires_grad=True)
        ent = torch.ones(batch["input_ids"].shape, device=rank.device, requires_grad=entropy_grad)
        return logp, ent if with_entropy else None

    samples = _samples()
    mine = list(range(len(samples)))
    fields = {
        "loss_mask": {i: s.loss_mask for i, s in enumerate(samples)},
        "behav": {i: s.logprobs for i, s in enumerate(samples)},
        "adv": {i: [s.reward - 1.0] * len(s.token_ids) for i, s in enumerate(samples)},
    }
    if loss == "decoupled_ppo":
        fields["prox"] = fields["behav"]
    if kl_coef:
        fields["ref"] = fields["behav"]
    batch = rank._batch(samples, mine, fields)
    logp, ent = fake_forward(batch, with_entropy=True, entropy_grad=entropy_coef > 0)
    loss, sums = rank._rl_loss(batch, logp, ent, denom=40.0)
    loss.backward()
    assert seen and set(sums) <= set(RL_SUMS)
    assert {v.device.type for v in sums.values()} == {"meta"}


# ---- a real 1-rank step on CPU, collectives checked ---------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_rank(tiny_model_path):
    """One in-process rank on CPU, its own gloo group (world size 1) for the module."""
    assert not dist.is_initialized()
    cfg = Config()
    cfg.trainer.micro_batch_tokens = 64  # several micro-batches: exercises the plan and the sums
    cfg.trainer.algorithm.loss = "decoupled_ppo"
    rank = W.TrainerRank(cfg.model_dump(by_alias=True), tiny_model_path, 0, 1)
    rank.setup("127.0.0.1", free_port())
    yield rank
    rank.shutdown()


def test_real_step_collectives_run_on_cpu_over_gloo(cpu_rank, strict, monkeypatch) -> None:
    """sft_step and train_step with STRICT_DEVICES on: every all_reduce gets a CPU tensor of a device type the
    group has a backend for, and the step's sums come back finite."""
    real = dist.all_reduce
    devices: list[str] = []

    def checked(t, *a, **kw):
        backends = {pair.split(":")[0] for pair in dist.get_backend_config().split(",")}
        assert t.device.type in backends, f"{t.device} tensor in a group for {backends}"
        devices.append(t.device.type)
        return real(t, *a, **kw)

    monkeypatch.setattr(W.dist, "all_reduce", checked)
    samples = _samples(8, seed=3)
    sft = cpu_rank.sft_step(samples)
    rl = cpu_rank.train_step(samples)
    assert devices and set(devices) == {"cpu"}
    assert all(v == v and abs(v) < 1e9 for v in [*sft.values(), *rl.values()])
    assert rl["train/model_tokens"] == sum(sum(s.loss_mask[1:]) for s in samples)


def test_zero_advantage_samples_are_skipped_and_the_step_is_unchanged(cpu_rank, monkeypatch) -> None:
    """One of four groups returned the same for every episode: GRPO gives its samples advantage 0 on every
    token, so (no KL or entropy term) their loss and gradient are exactly 0 and train_step skips them. The
    weights after the step (2 mini-batches, episode_mean) must equal those of a step that runs every sample:
    the skipped samples keep their share of the denominators."""
    import copy

    samples = _samples(12, seed=5)
    for i in (0, 1, 2):  # group g0; it shares a mini-batch with another group, whose denominator counts it
        samples[i].reward = -1.4  # not exact in binary: the group mean must not leave an ulp behind
    for i in (4, 7, 10):  # in g1-g3 no sample's reward equals its group's mean (advantage 0)
        samples[i].reward = 5.0
    monkeypatch.setattr(cpu_rank.alg, "mini_batches", 2)
    monkeypatch.setattr(cpu_rank.alg, "loss_agg", "episode_mean")
    optim = cpu_rank.tc.optim.model_copy(update={"lr": 1e-3, "eps": 1e-4})  # eps: see test_trainer_ranks._cfg
    model, version = cpu_rank.model, cpu_rank.version
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    initial = [p.detach().full_tensor().clone() for p in model.parameters()]

    real_plan = cpu_rank._plan

    def step(skip: bool) -> tuple[dict[str, float], list[torch.Tensor], set[int]]:
        cpu_rank.opt = cpu_rank.backend.optimizer(model, 10, optim)
        trained: set[int] = set()  # the samples the optimizer steps' micro-batches hold

        def plan(batch, mine=None, **kw):
            mbs = real_plan(batch, mine, **kw)
            if mine is not None:
                trained.update(i for mb in mbs for i in mb)
            return mbs

        cpu_rank._plan = plan
        if not skip:
            cpu_rank._without_gradient = lambda mine, advs: set()
        try:
            metrics = cpu_rank.train_step(copy.deepcopy(samples))
        finally:
            vars(cpu_rank).pop("_without_gradient", None)
            vars(cpu_rank).pop("_plan")
        weights = [p.detach().full_tensor().clone() for p in model.parameters()]
        model.load_state_dict(start)
        cpu_rank.version = version
        return metrics, weights, trained

    skipped, w_skip, trained = step(skip=True)
    full, w_full, all_trained = step(skip=False)
    assert trained == set(range(3, 12)) and all_trained == set(range(12))
    assert skipped["train/zero_advantage_frac"] == pytest.approx(0.25) and full["train/zero_advantage_frac"] == 0
    assert skipped["train/pg_loss"] == pytest.approx(full["train/pg_loss"], rel=1e-5, abs=1e-7)
    assert max(float((a - b).abs().max()) for a, b in zip(w_full, initial, strict=True)) > 1e-4  # the step moved
    assert all(torch.allclose(a, b, atol=1e-7, rtol=0) for a, b in zip(w_skip, w_full, strict=True))


# ---- (c) device RNG in checkpoints ---------------------------------------------------------------------------


class FakeDeviceRNG:
    """Stands in for torch.cuda's RNG functions (simulated: no CUDA here)."""

    def __init__(self) -> None:
        self.state = torch.tensor([1, 2, 3], dtype=torch.uint8)
        self.calls: list[torch.device] = []

    def get_rng_state(self, device):
        self.calls.append(device)
        return self.state.clone()

    def set_rng_state(self, state, device):
        self.calls.append(device)
        self.state = state.clone()


def test_device_rng_round_trips_through_checkpoint_simulated(cpu_rank, monkeypatch, tmp_path) -> None:
    """A fake torch.cuda RNG on a rank whose device is cuda:0 (simulated): save, change both generators, load."""
    fake = FakeDeviceRNG()
    monkeypatch.setattr(type(cpu_rank.plat), "device_module", lambda self: fake)
    monkeypatch.setattr(cpu_rank, "device", torch.device("cuda", 0))
    torch.manual_seed(11)
    cpu_saved = torch.get_rng_state()
    cpu_rank.save_checkpoint(str(tmp_path / "ckpt"))
    extra = torch.load(tmp_path / "ckpt" / "extra_rank0.pt", weights_only=False)
    assert torch.equal(extra["rng"]["cuda"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    fake.state = torch.tensor([9, 9, 9], dtype=torch.uint8)
    torch.rand(5)
    cpu_rank.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(fake.state, torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), cpu_saved)
    assert fake.calls == [torch.device("cuda", 0)] * 2


def test_rng_state_other_device_and_legacy_checkpoints_simulated() -> None:
    """A CUDA state is not fed to an NPU generator; an older checkpoint's bare CPU state still loads."""
    fake = FakeDeviceRNG()
    saved = ckpt.rng_state(fake, torch.device("cuda", 0))
    fake.state = torch.tensor([7], dtype=torch.uint8)
    ckpt.set_rng_state(saved, fake, torch.device("privateuseone", 0))  # another device type: left alone
    assert fake.state.tolist() == [7]
    torch.manual_seed(5)
    legacy = torch.get_rng_state()
    torch.rand(3)
    ckpt.set_rng_state(legacy, None, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), legacy)


# ---- device selection -----------------------------------------------------------------------------------------


class FakeDeviceModule:
    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def set_device(self, device) -> None:
        self.devices.append(device)


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_rank_selects_its_accelerator_simulated(monkeypatch, kind) -> None:
    """Simulated CUDA / NPU: the rank calls set_device of torch.cuda / torch.npu (a fake here) with its device."""
    fake = FakeDeviceModule()
    monkeypatch.setattr(W, "detect", lambda: plat.platform_for(kind, 1))
    monkeypatch.setattr(plat.Platform, "device_module", lambda self: fake)
    # torch.device("npu") exists only once torch_npu renamed the PrivateUse1 backend
    monkeypatch.setattr(plat.Platform, "torch_device", lambda self, index=0: torch.device("privateuseone", index))
    rank = W.TrainerRank(Config().model_dump(by_alias=True), "unused", 0, 1)
    assert fake.devices == [rank.device]
