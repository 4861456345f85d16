"""The local Ray a run starts when it joins no cluster: reachable from this machine only, without what a run
does not use, and gone with the run.

* Every Ray process binds the loopback address: the node's address is 127.0.0.1 (Ray binds its gRPC servers,
  agents and workers to the node's address; ``ray.init`` itself turns a loopback ``_node_ip_address`` into the
  machine's outward one, so the address is chosen the way Ray does on macOS, where local clusters are
  loopback-only); the workers' torch.distributed stores and gloo sockets use it too. The dashboard is not
  started and metrics are not collected or exported.
* A watchdog process (``hybridrl.runtime.watchdog``) stops what the run's Ray started and removes the run's
  Ray session folder when the driver ends, also when it is killed.

Joining a cluster (``cluster.address`` or ``RAY_ADDRESS``) keeps the cluster's own settings and is none of
this module's business.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the workers' environment on a local run: gloo's sockets on the loopback interface too (Linux names it lo).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")} if sys.platform == "linux" else {}

#: how long a clean stop waits for the watchdog to sweep and remove the session folder.
WATCHDOG_WAIT_S = 20.0


@dataclass
class LocalRay:
    session_dir: Path | None
    watchdog: subprocess.Popen | None


_current: LocalRay | None = None


def start_local_ray(num_cpus: int, runtime_env: dict[str, Any]) -> LocalRay:
    """``ray.init`` of a loopback-only local cluster for this run, its watchdog started."""
    global _current
    import ray

    restore = _loopback_node_address()
    on_main = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        ray.init(num_cpus=num_cpus, runtime_env=runtime_env, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, _system_config={"enable_metrics_collection": False})
    finally:
        restore()
    if on_main is not None:  # ray.init installs a SIGTERM handler that exits from wherever it lands
        signal.signal(signal.SIGTERM, on_main)
    session = _session_dir()
    _current = LocalRay(session, _start_watchdog(session))
    return _current


def stop_local_ray() -> None:
    """Shut the run's local Ray down and wait until the watchdog has swept what is left and removed the
    session folder. A no-op when this process started none (a joined cluster, a test's own Ray)."""
    global _current
    import ray

    current, _current = _current, None
    if current is None:
        return
    ray.shutdown()
    if current.watchdog is not None:
        current.watchdog.stdin.close()  # type: ignore[union-attr]
        try:
            current.watchdog.wait(timeout=WATCHDOG_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the Ray watchdog did not finish within %.0fs; Ray's session folder %s may remain",
                        WATCHDOG_WAIT_S, current.session_dir)


def owns_ray() -> bool:
    """Whether this process started the Ray it is connected to (``start_local_ray``)."""
    return _current is not None


def _loopback_node_address() -> Any:
    """Make Ray choose 127.0.0.1 as this node's address: what ``get_node_ip_address`` returns where Ray does
    not enable multi-node clusters (its ``ENABLE_RAY_CLUSTER`` switch, read at call time). Returns the undo,
    for once the node exists (its address is then fixed; a later join of a cluster must see the real one)."""
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - another Ray layout: its default address is used
        log.warning("this Ray version does not let a local cluster bind the loopback address only")
        return lambda: None
    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # pragma: no cover
        log.warning("this Ray version does not let a local cluster bind the loopback address only")
        return lambda: None
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False

    def restore() -> None:
        ray_constants.ENABLE_RAY_CLUSTER = before

    return restore


def _session_dir() -> Path | None:
    try:
        from ray._private import worker

        return Path(worker._global_node.get_session_dir_path())
    except (ImportError, AttributeError):  # pragma: no cover - another Ray layout: the folder stays
        return None


def _start_watchdog(session: Path | None) -> subprocess.Popen | None:
    if session is None:
        return None
    return subprocess.Popen([sys.executable, "-m", "hybridrl.runtime.watchdog", str(os.getpid()), str(session)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
