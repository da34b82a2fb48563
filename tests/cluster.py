"""A two-node Ray cluster on one host, for tests of multi-node runs.

The head node is `ray start --head` with its own temp dir. The second node is `ray start --address` run from a
different working directory inside a private mount namespace (`unshare --mount`, as root) with fresh tmpfs
mounts on /dev/shm and /tmp: it shares the disk (so a folder outside /tmp is a "shared filesystem") but not
/dev/shm or /tmp, as a second machine would not. Each node has a custom resource (`node_head`, `node_worker`) to
pin actors to it.

Teardown never runs `ray stop` (machine-wide: it would stop every other Ray on the host). Every process the
cluster started carries a marker in its environment and the second node's processes live in their own mount
namespace: teardown kills exactly those, and fails if one survives. The cluster uses Ray's token authentication
with a token of its own (in `env`), never ~/.ray/auth_token, which every Ray on the host shares.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers import free_port

HEAD_RESOURCE = "node_head"
WORKER_RESOURCE = "node_worker"
MARKER_VAR = "AGENTRL_TEST_CLUSTER"
REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


@dataclass
class TwoNodeCluster:
    address: str  # HOST:PORT of the head's GCS, for `ray_address` / `ray.init(address=...)`
    head_resource: str
    worker_resource: str
    shared_dir: Path  # on the disk both nodes see (not under /tmp): run dirs, checkpoints
    head_cwd: Path
    worker_cwd: Path
    env: dict[str, str]  # for drivers: the venv on PATH, the cluster's auth token, none of the caller's RAY_*
    head_proc: subprocess.Popen = field(repr=False)
    worker_proc: subprocess.Popen = field(repr=False)
    root: Path = field(repr=False)
    marker: str = field(repr=False)

    def pids(self) -> set[int]:
        """Live processes of this cluster (both nodes, their workers, drivers started with `env`)."""
        return _cluster_pids(self.marker, _mount_ns(self.worker_proc.pid))

    def actor_titles(self) -> dict[str, set[str]]:
        """The `ray::Class` process titles of live Ray workers on each node ("head", "worker")."""
        worker_ns = _mount_ns(self.worker_proc.pid)
        titles: dict[str, set[str]] = {"head": set(), "worker": set()}
        for pid in self.pids():
            cmd = _cmdline(pid).decode(errors="replace").strip()
            if cmd.startswith("ray::"):
                titles["worker" if _mount_ns(pid) == worker_ns else "head"].add(cmd.split()[0].split(".")[0])
        return titles

    def logs(self) -> str:
        """The tail of each node's `ray start` output and its raylet / GCS logs, for failure messages."""
        parts = []
        for name, proc, cwd in (("head", self.head_proc, self.head_cwd), ("worker", self.worker_proc, self.worker_cwd)):
            out = cwd / "ray_start.log"
            parts.append(f"--- {name} node: ray start (exit {proc.poll()}) ---\n{_tail(out)}")
        logs = {"head": self.root / "ray" / "session_latest" / "logs"}
        # The second node's logs are in its private /tmp: reachable through /proc/PID/root while it runs (and
        # only once it is in its own namespace: before that, that path is this host's /tmp).
        if _mount_ns(self.worker_proc.pid) not in (None, _mount_ns(os.getpid())):
            ray_tmp = Path(f"/proc/{self.worker_proc.pid}/root/tmp/ray")
            with contextlib.suppress(OSError):  # session_latest is an absolute link: resolve it in that namespace
                logs["worker"] = ray_tmp / Path(os.readlink(ray_tmp / "session_latest")).name / "logs"
        for name, folder in logs.items():
            for log in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):
                with contextlib.suppress(OSError):
                    if (folder / log).exists() and (folder / log).stat().st_size:
                        tail = _tail(folder / log, problems_only=log.endswith(".out"))
                        parts.append(f"--- {name} node: {log} (warnings and errors) ---\n{tail}")
        return "\n".join(parts)


def _tail(path: Path, chars: int = 3000, problems_only: bool = False) -> str:
    """The end of a log; with problems_only, only its warning / error lines (Ray's `[date time W|E|F pid tid]`)."""
    try:
        text = path.read_text(errors="replace")
        if problems_only:
            text = "\n".join(line for line in text.splitlines() if re.match(r"\[\S+ \S+ [WEF] ", line))
        return text[-chars:]
    except OSError as e:
        return f"<unreadable: {e}>"


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _cluster_pids(marker: str, worker_ns: str | None) -> set[int]:
    """Every live process whose environment holds the marker or that lives in the second node's namespace."""
    own_ns = _mount_ns(os.getpid())
    needle = f"{MARKER_VAR}={marker}".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":  # a zombie holds nothing; its parent reaps it
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            ns = _mount_ns(pid)
        except OSError:
            continue  # exited meanwhile
        if needle in env.split(b"\0") or (worker_ns is not None and ns == worker_ns and ns != own_ns):
            found.add(pid)
    return found


def _env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
    env[MARKER_VAR] = marker
    env["PYTHONUNBUFFERED"] = "1"
    # Token auth with this cluster's own token: nothing read from or written to ~/.ray (shared by every Ray
    # on the host, where another cluster may create or replace the default token).
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return env


# Polls the head's GCS (no driver needed) until a node with each wanted resource is alive; prints the alive nodes.
WAIT_FOR_NODES = """
import json, sys, time
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo

address, wanted, deadline = sys.argv[1], set(sys.argv[2].split(",")), time.monotonic() + float(sys.argv[3])
nodes = []
while True:
    try:
        infos = GcsClient(address=address).get_all_node_info(timeout=5).values()
        nodes = [{"node_id": i.node_id.hex(), "is_head": i.is_head_node, "resources": dict(i.resources_total)}
                 for i in infos if i.state == GcsNodeInfo.GcsNodeState.ALIVE]
    except Exception as e:
        nodes = [repr(e)]
    if wanted <= {r for n in nodes if isinstance(n, dict) for r in n["resources"]} or time.monotonic() > deadline:
        break
    time.sleep(0.3)
print(json.dumps(nodes))
sys.exit(0 if wanted <= {r for n in nodes if isinstance(n, dict) for r in n["resources"]} else 1)
"""


def _kill_all(cluster: TwoNodeCluster, timeout_s: float = 20.0) -> None:
    worker_ns = _mount_ns(cluster.worker_proc.pid)
    deadline = time.monotonic() + timeout_s
    for proc in (cluster.head_proc, cluster.worker_proc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    while True:
        pids = _cluster_pids(cluster.marker, worker_ns)
        if not pids:
            break
        if time.monotonic() > deadline:
            survivors = {pid: _tail(Path(f"/proc/{pid}/cmdline"), 200).replace("\0", " ") for pid in pids}
            raise AssertionError(f"two-node cluster: processes survived teardown: {survivors}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for proc in (cluster.head_proc, cluster.worker_proc):
        proc.wait(timeout=10)
    # A second, independent check: no process names the head's temp dir (raylet, GCS and workers all do).
    named = [pid for pid in _live_pids() if str(cluster.root).encode() in _cmdline(pid)]
    assert not named, f"two-node cluster: processes survived teardown: {named}"


def _live_pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) != os.getpid()]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


@contextlib.contextmanager
def two_node_cluster(num_cpus: int = 8, start_timeout_s: float = 90.0) -> Iterator[TwoNodeCluster]:
    """Start the two nodes, wait until both are alive in the GCS, yield, and always tear both down."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise RuntimeError("the two-node cluster needs root and unshare(1) (a private mount namespace per node)")
    # Outside /tmp (the second node has its own), and short: Ray's unix socket paths live under the temp dir.
    root = Path(tempfile.mkdtemp(prefix="a2n-", dir="/var/tmp"))
    marker = uuid.uuid4().hex
    env = _env(marker)
    ray_bin = str(Path(sys.executable).parent / "ray")
    port = free_port()
    address = f"{HOST}:{port}"
    head_cwd, worker_cwd, shared = root / "head", root / "worker", root / "shared"
    for d in (head_cwd, worker_cwd, shared):
        d.mkdir()
    common = [f"--num-cpus={num_cpus}", "--object-store-memory=200000000", f"--node-ip-address={HOST}",
              f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats", "--block"]  # fmt: skip
    head_cmd = [ray_bin, "start", "--head", f"--port={port}", f"--temp-dir={root / 'ray'}",
                f"--resources={json.dumps({HEAD_RESOURCE: 100})}", "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}", *common]  # fmt: skip
    worker_ray = [ray_bin, "start", f"--address={address}", "--temp-dir=/tmp/ray",
                  f"--resources={json.dumps({WORKER_RESOURCE: 100})}", *common]  # fmt: skip
    # Private copies of / (so the new mounts stay here), fresh /dev/shm and /tmp, another working directory.
    # The raylet and its workers are descendants of this shell, so they stay in the namespace. A checkout (or its
    # virtualenv) that itself lives under /tmp, as a CI clone may, is bound back over the fresh /tmp: the second
    # node runs the same code, as a real node with the same install would.
    keep = sorted({p for p in (str(REPO), sys.prefix) if p == "/tmp" or p.startswith("/tmp/")})
    hold = [root / f"hold{i}" for i in range(len(keep))]
    script = "; ".join([
        "set -e", "mount --make-rprivate /",
        *(f"mkdir -p {h} && mount --bind {shlex.quote(p)} {h}" for p, h in zip(keep, hold, strict=True)),
        "mount -t tmpfs tmpfs /dev/shm", "mount -t tmpfs tmpfs /tmp",
        *(f"mkdir -p {shlex.quote(p)} && mount --bind {h} {shlex.quote(p)}" for p, h in zip(keep, hold, strict=True)),
        f"cd {shlex.quote(str(worker_cwd))}", f"exec {shlex.join(worker_ray)}",
    ])  # fmt: skip
    # Both at once: the second node's `ray start` retries until the head's GCS answers.
    with open(head_cwd / "ray_start.log", "wb") as head_log, open(worker_cwd / "ray_start.log", "wb") as worker_log:
        head_proc = subprocess.Popen(head_cmd, cwd=head_cwd, env=env, stdout=head_log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        worker_proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", script], cwd=worker_cwd, env=env,
                                       stdout=worker_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)  # fmt: skip
    cluster = TwoNodeCluster(address, HEAD_RESOURCE, WORKER_RESOURCE, shared, head_cwd, worker_cwd, env,
                             head_proc, worker_proc, root, marker)  # fmt: skip
    try:
        waiter = subprocess.Popen([sys.executable, "-c", WAIT_FOR_NODES, address, f"{HEAD_RESOURCE},{WORKER_RESOURCE}",
                                   str(start_timeout_s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        while waiter.poll() is None and head_proc.poll() is None and worker_proc.poll() is None:
            time.sleep(0.1)
        if waiter.poll() is None:
            os.killpg(waiter.pid, signal.SIGKILL)
        nodes = waiter.communicate()[0].decode(errors="replace").strip()[-3000:]
        if waiter.returncode != 0:
            exited = {
                n: p.returncode for n, p in (("head", head_proc), ("worker", worker_proc)) if p.poll() is not None
            }
            why = f"ray start exited {exited}" if exited else f"not both nodes alive after {start_timeout_s:.0f} s"
            raise RuntimeError(f"two-node cluster at {address}: {why}; alive nodes: {nodes}\n{cluster.logs()}")
        yield cluster
    finally:
        try:
            _kill_all(cluster)
        finally:
            shutil.rmtree(root, ignore_errors=True)
