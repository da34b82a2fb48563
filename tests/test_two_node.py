"""A two-node Ray cluster on one host (tests/cluster.py): the second node has its own /dev/shm, /tmp and working
directory. Engines are pinned to it, the trainer and the driver stay on the head: training with collective weight
sync keeps engine and trainer log-probs equal, survives a SIGKILL of the driver and resumes from the checkpoint on
the shared disk; disk weight sync without a shared `weights_dir` is refused at start-up. What travels from the
driver: user modules from a folder the other node lacks, the collective libraries' settings; and the warm-start
cache is finished on the node that writes it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agentrl.observe.metrics import read_jsonl
from agentrl.run.state import latest_checkpoint
from tests.cluster import TwoNodeCluster, two_node_cluster

CONFIG = Path(__file__).parent / "configs" / "tiny_pipeline.yaml"
STEPS = 3
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodeCluster]:
    with two_node_cluster() as c:
        yield c


PROBE = """
import json, os, sys, uuid
import ray

ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)

@ray.remote(num_cpus=0)
class Probe:
    def where(self):
        import agentrl  # the venv's python on both nodes

        return {"node": ray.get_runtime_context().get_node_id(), "cwd": os.getcwd(), "python": sys.executable,
                "agentrl": agentrl.__file__}

    def write(self, name):
        for d in ("/dev/shm", "/tmp"):
            with open(os.path.join(d, name), "w") as f:
                f.write("head")

    def sees(self, name):
        return {d: os.path.exists(os.path.join(d, name)) for d in ("/dev/shm", "/tmp")}

    def remove(self, name):
        for d in ("/dev/shm", "/tmp"):
            os.remove(os.path.join(d, name))

head = Probe.options(resources={sys.argv[2]: 1}).remote()
worker = Probe.options(resources={sys.argv[3]: 1}).remote()
name = f"agentrl-two-node-{uuid.uuid4().hex}"
ray.get(head.write.remote(name))
try:
    out = {"driver": ray.get_runtime_context().get_node_id(), "head": ray.get(head.where.remote()),
           "worker": ray.get(worker.where.remote()), "head_sees": ray.get(head.sees.remote(name)),
           "worker_sees": ray.get(worker.sees.remote(name))}
finally:
    ray.get(head.remove.remote(name))
print("PROBE " + json.dumps(out))
"""


def test_nodes_are_separate_machines_but_share_the_disk(cluster):
    """Actors pinned by the custom resources land on different nodes; the second node has its own /dev/shm,
    /tmp and working directory, and runs the same python with agentrl."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PROBE, cluster.address, cluster.head_resource,
                           cluster.worker_resource], env=cluster.env, cwd=cluster.head_cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{cluster.logs()}"
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    head, worker = out["head"], out["worker"]
    assert head["node"] != worker["node"]
    assert out["driver"] == head["node"], "the driver attaches to the head node"
    assert out["head_sees"] == {"/dev/shm": True, "/tmp": True}
    assert out["worker_sees"] == {"/dev/shm": False, "/tmp": False}, "the second node shares /dev/shm or /tmp"
    assert head["cwd"] != worker["cwd"] and worker["cwd"] == str(cluster.worker_cwd), (head, worker)
    assert head["python"] == worker["python"] == sys.executable
    assert head["agentrl"] == worker["agentrl"]
    print(f"probe: {time.monotonic() - started:.1f} s")


def _config(cluster: TwoNodeCluster, name: str, **rollout) -> tuple[Path, Path]:
    """The tiny pipeline, joined to the cluster: engines on the second node, the trainer on the head."""
    cfg = yaml.safe_load(CONFIG.read_text())
    run_dir = cluster.shared_dir / name
    cfg.update(ray_address=cluster.address)
    cfg["rollout"].update(ray_resources={cluster.worker_resource: 1}, stop_after_failed_groups=4, **rollout)
    cfg["trainer"].update(ray_resources={cluster.head_resource: 1}, total_steps=STEPS, sft={"enabled": False})
    cfg["validation"] = {"every_steps": 0}
    cfg["checkpoint"] = {"every_steps": 1, "keep_last": 2}
    cfg["logging"] = {"run_dir": str(run_dir), "console": False, "tensorboard": False}
    path = cluster.shared_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def _train(spawn, cluster: TwoNodeCluster, config: Path, *extra: str, **kwargs) -> subprocess.Popen:
    # Started from the head's working directory: the driver runs on the head node.
    args = [sys.executable, "-m", "agentrl", "train", str(config), *extra]
    return spawn(args, env=cluster.env, cwd=cluster.head_cwd, **kwargs)


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@pytest.mark.slow
def test_collective_sync_across_nodes_kill_driver_and_resume(cluster, spawn):
    config, run_dir = _config(cluster, "collective", weight_sync="collective")
    first_log, resume_log = cluster.shared_dir / "collective-1.log", cluster.shared_dir / "collective-2.log"
    started = time.monotonic()
    with first_log.open("wb") as log:
        proc = _train(spawn, cluster, config, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    placed: dict[str, set[str]] = {"head": set(), "worker": set()}
    while latest_checkpoint(run_dir) is None:
        for node, titles in cluster.actor_titles().items():
            placed[node] |= titles
        assert proc.poll() is None, f"run exited {proc.returncode} before a checkpoint:\n{_tail(first_log)}"
        assert time.monotonic() < deadline, f"no checkpoint after 240 s:\n{_tail(first_log)}\n{cluster.logs()}"
        time.sleep(0.2)
    first_checkpoint = time.monotonic() - started
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "ray::VLLMEngine" in placed["worker"] and "ray::VLLMEngine" not in placed["head"], placed
    assert "ray::TrainerRank" in placed["head"] and "ray::TrainerRank" not in placed["worker"], placed

    with resume_log.open("wb") as log:
        proc = _train(spawn, cluster, config, "--resume", str(run_dir), stdout=log, stderr=subprocess.STDOUT)
    proc.wait(timeout=240)
    text = _tail(resume_log, 100_000)
    assert proc.returncode == 0, text[-4000:]
    assert "resuming from step" in text, text[-4000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert rows and rows[-1]["train/version"] == STEPS, rows
    assert {r["train/version"] for r in rows} >= set(range(1, STEPS + 1)), [r["train/version"] for r in rows]
    # After every sync the engines sample with the trainer's weights: their log-probs of the tokens they
    # generated equal the trainer's (both fp32 on CPU).
    diffs = {r["train/version"]: r.get("train/rollout_logprob_diff") for r in rows}
    assert all(d is not None and d < LOGPROB_TOLERANCE for d in diffs.values()), diffs
    assert latest_checkpoint(run_dir).name == f"step-{STEPS:06d}"
    print(f"first checkpoint {first_checkpoint:.1f} s, total {time.monotonic() - started:.1f} s, diffs {diffs}")


def test_disk_sync_without_a_shared_weights_dir_fails_at_start(cluster, spawn):
    """The default weights_dir (/dev/shm) is on the driver's node only: engines on the other node could never
    read it, so the run stops before training with one line naming `rollout.weights_dir`."""
    config, _ = _config(cluster, "disk", weight_sync="disk")
    started = time.monotonic()
    proc = _train(spawn, cluster, config, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=90)
    elapsed = time.monotonic() - started
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert proc.returncode != 0, (out.decode()[-2000:], lines[-20:])
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    assert lines and "weights_dir" in lines[-1], lines[-20:]
    assert not any("Traceback" in line for line in lines), lines[-40:]
    left = list(Path("/dev/shm").glob(f"agentrl-weights-*-{proc.pid}"))
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"the refused run left its weights folder behind: {left}"
    print(f"disk failure in {elapsed:.1f} s: {[line for line in lines if 'weights_dir' in line]}")


TRAVEL = """
import json, os, sys
import ray
from agentrl.platform import CPU
from agentrl.plugins import import_user_modules
from agentrl.run.startup import init_ray
from agentrl.run.warm_start import _save_warm_start

import_user_modules(["driver_side_envs"])  # what the CLI does for --import driver_side_envs
init_ray(sys.argv[1])

@ray.remote(num_cpus=0)
class Probe:
    def report(self):
        from agentrl import plugins

        names = ("NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT", "ASCEND_RT_VISIBLE_DEVICES")
        module = sys.modules.get("driver_side_envs")
        return {"node": ray.get_runtime_context().get_node_id(), "env": {k: os.environ.get(k) for k in names},
                "module": getattr(module, "WHERE", None), "import_errors": plugins.import_errors}

# an actor with an env of its own (as trainer ranks and engines have) and one without
ranked = Probe.options(resources={sys.argv[2]: 1}, runtime_env={"env_vars": CPU.actor_env()}).remote()
plain = Probe.options(resources={sys.argv[2]: 1}).remote()
out = {"driver": ray.get_runtime_context().get_node_id(), "ranked": ray.get(ranked.report.remote()),
       "plain": ray.get(plain.report.remote())}
print("PROBE " + json.dumps(out))
"""


def test_user_modules_and_collective_settings_reach_actors_on_the_other_node(cluster, tmp_path):
    """The driver runs in a folder under /tmp, which the other node does not have: its user module travels as
    Ray's py_modules (not as the driver's folder on PYTHONPATH); its NCCL_* / GLOO_* / HCCL_* settings reach the
    actors there (Ray starts workers from that node's raylet, whose environment is not the driver's); its
    visible-devices list does not."""
    (tmp_path / "driver_side_envs.py").write_text('WHERE = "the driver\'s folder"\n')
    env = {**cluster.env, "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo", "HCCL_CONNECT_TIMEOUT": "1234",
           "ASCEND_RT_VISIBLE_DEVICES": "7"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", TRAVEL, cluster.address, cluster.worker_resource], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{cluster.logs()}"
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    for actor in ("ranked", "plain"):
        got = out[actor]
        assert got["node"] != out["driver"], "the probe runs on the other node"
        assert got["import_errors"] == [] and got["module"] == "the driver's folder", got
        assert got["env"] == {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo", "HCCL_CONNECT_TIMEOUT": "1234",
                              "ASCEND_RT_VISIBLE_DEVICES": None}, got  # fmt: skip


WARM_CACHE = """
import json, os, sys
from pathlib import Path
import ray
from agentrl.config import load_config
from agentrl.run.startup import init_ray
from agentrl.run.warm_start import _save_warm_start
from agentrl.trainer import TrainerGroup

init_ray(sys.argv[1])
path = Path(sys.argv[3])
trainer = TrainerGroup(load_config(None, ["trainer.ray_resources={%s: 1}" % sys.argv[2], "name=warm-cache"]))
_save_warm_start(trainer.save_warm_start, path)  # what the warm start does at its end

@ray.remote(num_cpus=0)
def look(folder):
    folder = Path(folder)
    found = sorted(p.name for p in folder.parent.iterdir()) if folder.parent.is_dir() else []
    done = (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    import shutil
    shutil.rmtree(folder.parent, ignore_errors=True)
    return {"node": ray.get_runtime_context().get_node_id(), "done": done, "found": found}

out = {"driver_sees": path.exists(), "rank0_node": ray.get(look.options(resources={sys.argv[2]: 1}).remote(str(path)))}
trainer.shutdown()
print("PROBE " + json.dumps(out))
"""


def test_the_warm_start_cache_is_finished_on_the_node_that_writes_it(cluster, tmp_path):
    """model.cache_dir under /tmp is one node's: trainer rank 0 (on the other node) writes the cached warm start
    there and must also rename it into place there; the driver, which cannot see it, says so."""
    path = f"/tmp/agentrl-warm-{uuid.uuid4().hex[:8]}/warmstart-test"  # /tmp: each node has its own
    args = [sys.executable, "-c", WARM_CACHE, cluster.address, cluster.worker_resource, path]
    proc = subprocess.run(args, env=cluster.env, cwd=cluster.head_cwd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{cluster.logs()}"
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert out["rank0_node"]["done"], out
    assert out["rank0_node"]["found"] == ["warmstart-test"], out  # no temporary folder left beside it
    assert not out["driver_sees"], out
    assert "which this driver does not see: set model.cache_dir to a folder every node shares" in proc.stderr
