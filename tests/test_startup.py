"""Start-up checks that need a Ray cluster: asking for more accelerators than it has fails at once, in one line,
instead of leaving actors pending forever. And what a run's start costs: the router's process loads no torch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from agentrl.config import Config, ConfigError
from agentrl.run import startup


def test_more_devices_than_the_cluster_has_is_one_line_at_once(ray_session) -> None:
    """A CUDA run (cfg.platform=cuda) against the real local Ray cluster, which has no GPU resource: the platform
    comes from the config and the cluster, so the check needs no GPU in this process."""
    cfg = Config.model_validate({"rollout": {"num_engines": 3}, "trainer": {"num_ranks": 2}})
    startup.check_cluster_resources(cfg)  # auto on a cluster without GPU/NPU: CPU, the actors ask for no device
    cuda = cfg.model_copy(update={"platform": "cuda"})
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        startup.check_cluster_resources(cuda)
    assert time.monotonic() - t0 < 10
    message = str(err.value)
    assert "\n" not in message and message.startswith("the run needs 5 GPU (3 rollout engines x 1 + 2 trainer ranks)")
    assert "the Ray cluster has 0" in message and "lower rollout.num_engines" in message
    remote = Config.model_validate(
        {"platform": "cuda", "rollout": {"backend": "remote", "url": "http://x", "num_engines": 3}}
    )
    with pytest.raises(ConfigError, match="needs 1 GPU \\(0 rollout engines x 1 \\+ 1 trainer ranks\\)"):
        startup.check_cluster_resources(remote)


@pytest.mark.parametrize(
    ("config_address", "env_address", "local"),
    [("local", None, True), (None, "local", True), ("auto", "local", True), (None, "10.0.0.1:6379", False),
     ("auto", None, False), ("10.0.0.1:6379", "local", False)],
)  # fmt: skip
def test_which_addresses_start_a_ray_of_this_machine_alone(monkeypatch, config_address, env_address, local) -> None:
    """The local-device check applies exactly when `ray.init` would start a new local cluster: RAY_ADDRESS counts
    where the config gives no address or "auto" (as in Ray), and "local" is one even with other clusters here."""
    from agentrl.run.preflight import _starts_local_ray

    if env_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env_address)
    assert _starts_local_ray(Config.model_validate({"ray_address": config_address})) is local


def test_the_router_process_imports_no_torch() -> None:
    """The router actor's process loads the rollout modules (agentrl.rollout.vllm_engine among them) but never runs a
    model: importing torch there cost ~3 CPU-seconds of each run's start (the LoRA adapter helpers imported it)."""
    code = (
        "import sys, agentrl.rollout.router, agentrl.rollout.fleet, agentrl.rollout.vllm_engine; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
