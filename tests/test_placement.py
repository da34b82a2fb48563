"""Platform from the cluster, placement of engines and trainer ranks, and the resource check before any actor
starts. The pure functions are tested directly; the Ray part runs once, in a subprocess (this file run as a
script), against a real two-node local Ray cluster with fake GPU and custom resources (`ray.cluster_utils`), since
the test session's own Ray has neither and one process can join one Ray only. No real GPU is needed anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import pytest

from agentrl.config import Config, ConfigError
from agentrl.placement import Placement, actor_options, bundle, create_placement
from agentrl.platform import CPU, platform_choice, platform_for, run_platform, worker_env
from agentrl.rollout.fleet import EngineSpec, engine_kwargs, engine_options
from agentrl.run.startup import check_cluster_resources

CUDA, NPU = platform_for("cuda", 8), platform_for("npu", 8)


def _cfg(**sections) -> Config:
    return Config.model_validate(sections)


def test_run_platform_comes_from_cluster_resources_not_the_driver(monkeypatch) -> None:
    assert run_platform("auto", {"CPU": 8, "GPU": 4}).kind == "cuda"
    assert run_platform("auto", {"CPU": 8, "GPU": 4}).device_count == 4
    npu = run_platform("auto", {"NPU": 16, "GPU": 2})
    assert (npu.kind, npu.device_count, npu.ray_resource) == ("npu", 16, "NPU")
    assert run_platform("auto", {"CPU": 8}) is CPU
    assert run_platform("cpu", {"GPU": 4}) is CPU  # a CPU run on a GPU cluster asks for no device
    forced = run_platform("cuda", {"CPU": 2})  # forcing works on a cluster without the resource; the check catches it
    assert (forced.kind, forced.device_count, forced.dist_backend) == ("cuda", 0, "nccl")
    with pytest.raises(ValueError, match="auto, cpu, cuda or npu"):
        run_platform("tpu", {})
    monkeypatch.setenv("AGENTRL_PLATFORM", "cpu")
    assert platform_choice("auto") == "cpu" and platform_choice("cuda") == "cuda"
    monkeypatch.delenv("AGENTRL_PLATFORM")
    assert platform_choice("auto") == "auto"
    # thread caps follow the run's platform, not the (GPU-less) driver's
    assert "OMP_NUM_THREADS" not in worker_env(CUDA) and worker_env(CPU)["OMP_NUM_THREADS"] == "1"


def test_bundles_and_actor_options_per_platform() -> None:
    assert bundle(CUDA, 2, {"node2": 1}) == {"node2": 1.0, "GPU": 2.0}
    assert actor_options(CUDA, 2, {"node2": 1}) == {"num_gpus": 2, "num_cpus": 0, "resources": {"node2": 1.0}}
    assert bundle(NPU, 1, {}) == {"NPU": 1.0}
    assert actor_options(NPU, 1, {"node2": 0.5}) == {"num_cpus": 0, "resources": {"NPU": 1, "node2": 0.5}}
    assert bundle(CPU, 4, {}) == {} and actor_options(CPU, 4, {}) == {"num_cpus": 0}  # Ray rejects empty bundles
    assert bundle(CPU, 4, {"node_a": 1, "zero": 0}) == {"node_a": 1.0}
    assert create_placement(CPU, 1, {}, count=2).group is None  # nothing to reserve: no Ray call, no group
    # past the placement group's slots (an engine the caller adds later) the actor asks for the same, unplaced
    slots = Placement(CUDA, 2, {"node2": 1}, count=2, group=object())
    assert "scheduling_strategy" not in slots.options(2) and slots.options(2)["num_gpus"] == 2


def test_engine_options_carry_the_platform_and_tensor_parallel_devices() -> None:
    ro = _cfg(rollout={"tensor_parallel_size": 2, "ray_resources": {"node2": 1}}).rollout
    opts = engine_options(ro, CUDA, None, 0)
    assert opts["num_gpus"] == 2 and opts["resources"] == {"node2": 1.0} and opts["num_cpus"] == 0
    assert opts["runtime_env"]["env_vars"]["AGENTRL_PLATFORM"] == "cuda"
    assert engine_kwargs(EngineSpec(ro, "/m", seed=3)) == {"model_path": "/m", "cfg": ro, "seed": 3}  # one settings
    assert engine_kwargs(EngineSpec(ro, "/m", seed=3), index=2)["seed"] == 5  # engine i samples with seed + i
    cpu = engine_options(_cfg().rollout, CPU, None, 0)
    assert cpu["runtime_env"]["env_vars"]["AGENTRL_PLATFORM"] == "cpu" and "resources" not in cpu
    remote = _cfg(rollout={"backend": "remote", "url": "http://x", "tensor_parallel_size": 2}).rollout
    opts = engine_options(remote, CUDA, None, 1)  # an HTTP client: no device, no vLLM environment
    assert "num_gpus" not in opts and opts["runtime_env"]["env_vars"] == {"AGENTRL_PLATFORM": "cuda"}


def test_resource_check_names_totals_custom_resources_and_per_node_needs() -> None:
    two = [{"GPU": 1.0}, {"GPU": 1.0}]
    with pytest.raises(ConfigError) as err:
        check_cluster_resources(_cfg(platform="cuda", rollout={"num_engines": 3}), None, {"GPU": 2.0}, two)
    assert str(err.value).startswith("the run needs 4 GPU (3 rollout engines x 1 + 1 trainer ranks)")
    assert "the Ray cluster has 2" in str(err.value) and "lower rollout.num_engines" in str(err.value)
    three = [{"GPU": 1.0}] * 3
    cfg = _cfg(platform="cuda", rollout={"tensor_parallel_size": 2})
    with pytest.raises(ConfigError) as err:
        check_cluster_resources(cfg, None, {"GPU": 3.0}, three)  # 3 in total, but no node has 2
    message = str(err.value)
    assert message.startswith("each rollout engine needs 2 GPU on one node") and "\n" not in message
    assert "hold 0 such rollout engines of the 1" in message and "rollout.tensor_parallel_size" in message
    check_cluster_resources(cfg, None, {"GPU": 3.0}, [{"GPU": 2.0}, {"GPU": 1.0}])  # fits: passes
    remote = _cfg(platform="cuda", rollout={"backend": "remote", "url": "http://x", "num_engines": 3})
    check_cluster_resources(remote, None, {"GPU": 1.0}, [{"GPU": 1.0}])  # remote engines need no device
    check_cluster_resources(_cfg(rollout={"num_engines": 8}), None, {"CPU": 2.0}, [{"CPU": 2.0}])  # auto: CPU


def _cluster_scenario() -> dict:
    """Run as a script: a real 2-node Ray cluster with fake resources; prints what the tests assert on."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    from agentrl.platform import cluster_platform
    from agentrl.rollout import fleet
    from agentrl.trainer.group import TrainerGroup

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 1, "resources": {"node_a": 2}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, num_gpus=1, resources={"node_a": 2})
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    out: dict = {"auto": [cluster_platform().kind, cluster_platform().device_count]}

    def failure(cfg: Config) -> list:
        t0 = time.monotonic()
        try:
            check_cluster_resources(cfg)
        except ConfigError as e:
            return [str(e), time.monotonic() - t0]
        return ["passed", time.monotonic() - t0]

    out["three_engines"] = failure(_cfg(platform="cuda", rollout={"num_engines": 3}, trainer={"num_ranks": 1}))
    out["node2"] = failure(_cfg(platform="cpu", rollout={"ray_resources": {"node2": 1}}))
    out["per_node"] = failure(_cfg(platform="cpu", rollout={"num_engines": 3, "ray_resources": {"node_a": 1.2}}))
    out["fits"] = failure(_cfg(platform="cuda", rollout={"num_engines": 1}))

    class FakeEngine:
        """A stand-in engine (no model): reports the environment and placement Ray gave it."""

        def __init__(self, **engine_kwargs) -> None:
            self.kwargs = engine_kwargs

        def where(self) -> dict:
            ctx = ray.get_runtime_context()
            return {
                "env": os.environ.get("AGENTRL_PLATFORM"),
                "pg": ctx.get_placement_group_id(),
                "node": ctx.get_node_id(),
            }

    fleet.engine_class = lambda backend: FakeEngine
    ro = _cfg(rollout={"num_engines": 2, "ray_resources": {"node_a": 1}}).rollout
    engines = fleet.create_engines(fleet.EngineSpec(ro, "unused-model"), platform=CPU)
    table = placement_group_table(engines.placement.group)
    out["pg"] = [engines.placement.group.id.hex(), table["strategy"], list(table["bundles"].values())]
    out["engines"] = ray.get([h.where.remote() for h in engines])
    out["bundle_nodes"] = [table["bundles_to_node_id"][i] for i in range(2)]
    ray.kill(engines[1])
    deadline = time.monotonic() + 60  # ray.kill returns at once: restart in the bundle once the old actor is gone
    while time.monotonic() < deadline:
        try:
            ray.get(engines[1].where.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.05)
    out["restarted"] = ray.get(engines.factory(1).where.remote(), timeout=60)  # the router's restart path

    class FakeRank:
        """A stand-in trainer rank (no model): reports the environment and placement Ray gave it."""

        def __init__(self, cfg_dict, path, rank, world) -> None:
            self.rank = rank

        where = FakeEngine.where

    sys.modules["agentrl.trainer.worker"] = types.SimpleNamespace(TrainerRank=FakeRank)  # type: ignore[assignment]
    group = TrainerGroup.__new__(TrainerGroup)
    cfg = _cfg(trainer={"num_ranks": 2, "ray_resources": {"node_a": 0.5}})
    ranks = group._create_ranks(cfg, "unused-model", CPU)
    out["ranks"] = ray.get([r.where.remote() for r in ranks])
    out["ranks_pg"] = [
        group._placement.group.id.hex(),
        list(placement_group_table(group._placement.group)["bundles"].values()),
    ]
    ray.shutdown()
    cluster.shutdown()
    return out


@pytest.fixture(scope="module")
def cluster_run() -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAY_DEDUP_LOGS": "0"}
    env.pop("AGENTRL_PLATFORM", None)
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=240, env=env, cwd=os.getcwd()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_real_cluster_checks_fail_fast_in_one_line(cluster_run) -> None:
    assert cluster_run["auto"] == ["cuda", 2]  # from the cluster's (fake) GPUs; this process has no GPU
    message, seconds = cluster_run["three_engines"]
    assert seconds < 10 and "\n" not in message
    assert message.startswith("the run needs 4 GPU (3 rollout engines x 1 + 1 trainer ranks) and the Ray cluster has 2")
    message, _ = cluster_run["node2"]
    assert message.startswith("the run needs 1 node2 (1 rollout engines x 1 from rollout.ray_resources)")
    assert "the Ray cluster has 0" in message and "rollout.ray_resources" in message
    message, _ = cluster_run["per_node"]  # 3.6 node_a in total of 4, but one engine (1.2) per node of 2
    assert message.startswith("each rollout engine needs 1.2 node_a on one node") and "hold 2 such" in message
    assert cluster_run["fits"][0] == "passed"


def test_real_cluster_engines_and_ranks_are_placed_and_restarted_in_their_bundle(cluster_run) -> None:
    pg, strategy, bundles = cluster_run["pg"]
    assert strategy == "PACK" and len(bundles) == 2 and all(b.get("node_a") == 1.0 for b in bundles)
    assert all(e["env"] == "cpu" and e["pg"] == pg for e in cluster_run["engines"])
    assert [e["node"] for e in cluster_run["engines"]] == cluster_run["bundle_nodes"]
    restarted = cluster_run["restarted"]
    assert restarted["pg"] == pg and restarted["node"] == cluster_run["bundle_nodes"][1]
    ranks_pg, rank_bundles = cluster_run["ranks_pg"]
    assert rank_bundles == [{"node_a": 0.5}, {"node_a": 0.5}]
    assert all(r["env"] == "cpu" and r["pg"] == ranks_pg for r in cluster_run["ranks"])


if __name__ == "__main__":
    print(json.dumps(_cluster_scenario()))
