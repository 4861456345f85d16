"""``hybridrl cluster up | down``: start the Ray nodes of a cluster on the machines that run them, and stop
exactly those again.

Each node is one ``ray start --block`` process in a session of its own, bound to the address it is given
(``--node-ip``: the interface other nodes reach it on), with its own Ray temp folder. A *cluster folder*
(``--dir``; on a real cluster a shared one) holds what the nodes and the driver need in common:

* ``auth_token``: Ray's token authentication (on by default since Ray 2.5x for a head started with
  ``ray start``): the head writes a fresh one unless the environment names one (``RAY_AUTH_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH``) or turns it off (``RAY_AUTH_MODE=disabled``); every node and driver reads it;
* ``cluster.json``: the head's address and the environment a driver sets (``env``, ``hybridrl cluster env``);
* ``nodes/*.json``: one record per node started (host, address, pid and start time of its process), so that
  ``down`` signals only processes it started, on this machine, never a reused pid;
* ``logs/``: each node's output.

Ray's own session folder (sockets, spill files) is kept on the node's local disk, not in the cluster folder:
under the system's temp folder with a short name (``ray_temp_dir``), since a Unix socket's path is limited to
107 bytes and a shared filesystem is no place for sockets.

On one machine (tests, a laptop) every node needs an address of its own: 127.0.0.2, 127.0.0.3, ... are
loopback addresses on Linux that Ray keeps as given (127.0.0.1 and ``localhost`` it replaces by the machine's
outward address). Gloo and NCCL bind the interface that holds the node's address (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``, unless already set), so the collectives stay on it too.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError

log = logging.getLogger(__name__)

#: the GCS port of a head started without ``--port`` (Ray's default).
DEFAULT_PORT = 6379
#: how long ``up`` waits for its node to register with the head.
START_TIMEOUT_S = 180.0
#: how long ``down`` waits after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0
#: a head binds these on its node address; a worker runs a raylet and its agents only.
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class ClusterError(HybridRLError, RuntimeError):
    """A node could not be started or stopped; the message says why and where its log is."""

    exit_status = 2  # refused before any work


@dataclass(frozen=True)
class NodeRecord:
    """One node ``up`` started: enough for ``down`` to stop it, and only it."""

    head: bool
    address: str  # the head's GCS address, host:port
    node_ip: str
    host: str  # the machine's name: ``down`` stops the nodes of the machine it runs on
    pid: int  # the ``ray start --block`` process
    started: float  # its start time (psutil's create_time): a reused pid is never signalled
    log: str
    temp_dir: str

    @property
    def name(self) -> str:
        return f"{'head' if self.head else 'worker'} {self.node_ip} (pid {self.pid})"


# --- the cluster folder ---------------------------------------------------------------------------------

def default_folder() -> Path:
    return Path(os.environ.get("HYBRIDRL_CLUSTER_DIR", Path.home() / ".hybridrl" / "cluster"))


def read_cluster(folder: Path) -> dict[str, Any]:
    path = folder / "cluster.json"
    if not path.is_file():
        raise ClusterError(f"no cluster in '{folder}' (no cluster.json): start its head with "
                           f"hybridrl cluster up --head --dir {folder}")
    return json.loads(path.read_text())


def driver_env(folder: Path) -> dict[str, str]:
    """What a driver (``hybridrl train``, a test) sets to join the cluster of ``folder``."""
    return dict(read_cluster(folder)["env"])


def auth_env(folder: Path) -> dict[str, str]:
    """Ray's token authentication for the nodes and drivers of ``folder``: the environment's own choice when it
    makes one, else a token file in the folder (written once, by the head)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {"RAY_AUTH_MODE": "disabled"}
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return {"RAY_AUTH_MODE": "token"}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str((folder / "auth_token").resolve())}


def _write_token(folder: Path) -> None:
    path = folder / "auth_token"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)


# --- addresses and interfaces ---------------------------------------------------------------------------

def check_node_ip(node_ip: str) -> None:
    """Refuse an address Ray would not keep, or that no interface of this machine holds."""
    if node_ip in _LOOPBACK_NAMES:
        raise ClusterError(f"--node-ip {node_ip}: Ray replaces it by this machine's outward address; for nodes on "
                           "one machine give each its own loopback address (127.0.0.2, 127.0.0.3, ...)")
    if interface_of(node_ip) is None:
        raise ClusterError(f"--node-ip {node_ip}: no interface of this machine holds that address")


def interface_of(node_ip: str) -> str | None:
    """The network interface whose network holds ``node_ip`` (``lo`` for any 127.x address on Linux)."""
    import psutil

    try:
        ip = ipaddress.ip_address(node_ip)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6) or not addr.netmask:
                continue
            try:
                network = ipaddress.ip_network(f"{addr.address.split('%')[0]}/{addr.netmask}", strict=False)
            except ValueError:
                continue
            if ip in network:
                return name
    return None


def collective_env(node_ip: str | None) -> dict[str, str]:
    """Gloo and NCCL on the interface of the node's address, unless the environment already chose one."""
    name = interface_of(node_ip) if node_ip else None
    if name is None:
        return {}
    return {key: os.environ.get(key, name) for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- up -------------------------------------------------------------------------------------------------

#: attempts at starting a node: on a loaded machine a raylet may give up waiting for its agents (Ray's "The
#: current node timed out during startup"); a second try usually gets through.
START_ATTEMPTS = 2


def start_node(folder: Path, *, head: bool, address: str | None = None, node_ip: str | None = None,
               port: int | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
               resources: dict[str, float] | None = None, timeout_s: float = START_TIMEOUT_S,
               attempts: int = START_ATTEMPTS) -> NodeRecord:
    """Start a head (``head=True``) or a worker joining ``address`` (default: the folder's head), and wait until
    it has registered with the head; a node that exits while starting is tried again (``attempts`` in all).
    Raises ``ClusterError`` naming the node's log when it does not start."""
    for attempt in range(1, attempts + 1):
        try:
            return _start_node_once(folder, head=head, address=address, node_ip=node_ip, port=port,
                                    num_cpus=num_cpus, num_gpus=num_gpus, resources=resources, timeout_s=timeout_s)
        except ClusterError as exc:
            if attempt == attempts or "while starting" not in str(exc):
                raise
            log.warning("%s; trying again (%d of %d)", str(exc).splitlines()[0], attempt + 1, attempts)
    raise AssertionError("unreachable")


def _start_node_once(folder: Path, *, head: bool, address: str | None, node_ip: str | None, port: int | None,
                     num_cpus: int | None, num_gpus: int | None, resources: dict[str, float] | None,
                     timeout_s: float) -> NodeRecord:
    folder = folder.resolve()
    for sub in ("nodes", "logs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    if node_ip is not None:
        check_node_ip(node_ip)
    if head:
        if "RAY_AUTH_TOKEN_PATH" in auth_env(folder):
            _write_token(folder)
        host_ip = node_ip or _outward_ip()
        port = port or DEFAULT_PORT
        address = f"{host_ip}:{port}"
    elif address is None:
        address = read_cluster(folder)["address"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **auth_env(folder), **collective_env(node_ip)}
    label = f"{'head' if head else 'worker'}-{node_ip or socket.gethostname()}-{int(time.time() * 1000)}"
    temp_dir = ray_temp_dir(folder, label)
    args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
            "--temp-dir", temp_dir]
    if head:
        args += ["--head", "--port", str(port), "--include-dashboard", "false",
                 "--system-config", json.dumps({"enable_metrics_collection": False})]
    else:
        args += ["--address", address]
    if node_ip:
        args += ["--node-ip-address", node_ip]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        args += ["--num-gpus", str(num_gpus)]
    if resources:
        args += ["--resources", json.dumps(resources)]
    log_path = folder / "logs" / f"{label}.log"
    since = time.time()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, close_fds=True)
    import psutil

    record = NodeRecord(head, address, node_ip or "", socket.gethostname(), proc.pid,
                        psutil.Process(proc.pid).create_time(), str(log_path), temp_dir)
    (folder / "nodes" / f"{label}.json").write_text(json.dumps(asdict(record), indent=2))
    try:
        _wait_registered(proc, record, env, since, timeout_s)
    except BaseException:
        _stop_record(record)
        shutil.rmtree(record.temp_dir, ignore_errors=True)
        (folder / "nodes" / f"{label}.json").unlink(missing_ok=True)
        raise
    if head:
        driver = {"RAY_ADDRESS": address, **auth_env(folder), **collective_env(node_ip)}
        (folder / "cluster.json").write_text(json.dumps({"address": address, "env": driver}, indent=2))
    return record


def ray_temp_dir(folder: Path, label: str) -> str:
    """A short, node-local folder for Ray's session of the node ``label`` of ``folder``."""
    import hashlib
    import tempfile

    digest = hashlib.sha1(f"{folder}/{label}".encode()).hexdigest()[:10]
    return str(Path(tempfile.gettempdir()) / f"hybridrl-ray-{digest}")


def _outward_ip() -> str:
    from hybridrl.runtime.distributed import node_ip

    return node_ip()


def _wait_registered(proc: subprocess.Popen, record: NodeRecord, env: dict[str, str], since: float,
                     timeout_s: float) -> None:
    """Until the head's GCS lists this node alive (its address, started after ``since``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"{record.name} exited with status {proc.returncode} while starting:\n"
                               f"{_tail(record.log)}\n(log: {record.log})")
        if _registered(record, env, since):
            return
        time.sleep(1.0)
    raise ClusterError(f"{record.name} did not register with the head at {record.address} within {timeout_s:.0f}s "
                       f"(log: {record.log})")


def _registered(record: NodeRecord, env: dict[str, str], since: float) -> bool:
    """Asks the head in a short-lived subprocess (the GCS client reads the token settings from its
    environment at import, and a driver process may hold other ones)."""
    code = ("import sys, json\n"
            "from ray._raylet import GcsClient\n"
            "from ray.core.generated.gcs_pb2 import GcsNodeInfo\n"
            f"infos = GcsClient(address={record.address!r}).get_all_node_info(timeout=5).values()\n"
            "print(json.dumps([[i.node_manager_address, i.start_time_ms]"
            " for i in infos if i.state == GcsNodeInfo.GcsNodeState.ALIVE]))\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    if done.returncode != 0:
        return False
    try:
        alive = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    ip = record.node_ip or record.address.rpartition(":")[0]
    return any(addr == ip and started_ms >= (since - 5) * 1000 for addr, started_ms in alive)


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- down -----------------------------------------------------------------------------------------------

def node_records(folder: Path, this_host_only: bool = True) -> list[tuple[Path, NodeRecord]]:
    out = []
    for path in sorted((folder / "nodes").glob("*.json")):
        try:
            record = NodeRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if not this_host_only or record.host == socket.gethostname():
            out.append((path, record))
    return out


def stop_nodes(folder: Path, workers_first: bool = True) -> list[NodeRecord]:
    """Stop every node of ``folder`` started on this machine (workers before the head), each with the
    processes it started; their records go. Returns the nodes stopped."""
    records = node_records(folder.resolve())
    records.sort(key=lambda pr: pr[1].head if workers_first else not pr[1].head)
    stopped = []
    for path, record in records:
        _stop_record(record)
        shutil.rmtree(record.temp_dir, ignore_errors=True)
        path.unlink(missing_ok=True)
        stopped.append(record)
    return stopped


def node_processes(record: NodeRecord) -> list[Any]:
    """The node's ``ray start`` process (when it is still the one started) and every process below it."""
    import psutil

    try:
        root = psutil.Process(record.pid)
        if abs(root.create_time() - record.started) > 1e-3:
            return []
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _stop_record(record: NodeRecord, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the node's processes (the raylet, the GCS, agents, workers), SIGKILL what is left after
    ``grace_s``. The tree is read first: a child whose parent went is still found."""
    import psutil

    from hybridrl.runtime.watchdog import terminate_then_kill

    terminate_then_kill(psutil, node_processes(record), grace_s)


def raylet_of(record: NodeRecord) -> Any | None:
    """The node's raylet process (killing it is how a test loses a node)."""
    for proc in node_processes(record):
        try:
            if proc.name() == "raylet":
                return proc
        except Exception:  # noqa: BLE001 - psutil.Error: gone meanwhile
            continue
    return None
