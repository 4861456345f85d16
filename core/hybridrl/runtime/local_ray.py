"""The local Ray a run starts when it joins no cluster: reachable from this machine only, without what a run
does not use, and gone with the run.

* Every Ray process binds the loopback address: the node's address is 127.0.0.1 (Ray binds its gRPC servers,
  agents and workers to the node's address; ``ray.init`` itself turns a loopback ``_node_ip_address`` into the
  machine's outward one, so the address is chosen the way Ray does on macOS, where local clusters are
  loopback-only); the workers' torch.distributed stores and gloo sockets use it too.
* No HTTP server: ``include_dashboard=False`` still starts Ray's dashboard head (an HTTP server for usage
  statistics) and its autoscaler monitor (an unauthenticated Prometheus endpoint), and the dashboard agent
  serves HTTP; a fixed local cluster needs none of them, so the head and the monitor are not started and the
  agent runs as in Ray's minimal install (no HTTP server; ``_without_http_servers``). Metrics are not collected.
  What remains: the runtime-env agent's HTTP server, which the raylet itself talks to (loopback, token-checked).
* Ray's token (token authentication, on by default for a local ``ray.init``) is the run's own: written with mode
  0600 into a private folder (``RAY_AUTH_TOKEN_PATH``), never into ``~/.ray/auth_token``, and removed at the end.
* A watchdog process (``hybridrl.runtime.watchdog``), started before Ray, stops what the run's Ray started and
  removes the run's Ray session folder and token when the driver ends, also when it is killed or interrupted
  while Ray starts.

Joining a cluster (``cluster.address`` or ``RAY_ADDRESS``) keeps the cluster's own settings and is none of
this module's business.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the workers' environment on a local run: gloo's sockets on the loopback interface too (Linux names it lo).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")} if sys.platform == "linux" else {}

#: how long a clean stop waits for the watchdog to sweep and remove the session folder.
WATCHDOG_WAIT_S = 20.0


#: the token variables of Ray's token authentication (``ray._private.authentication``).
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass
class LocalRay:
    session_dir: Path | None
    watchdog: subprocess.Popen | None
    token_dir: Path | None = None  # the run's own token folder (None: the environment chose the token)
    env_before: dict[str, str | None] = field(default_factory=dict)  # the token variables before the run


_current: LocalRay | None = None


def start_local_ray(num_cpus: int, runtime_env: dict[str, Any]) -> LocalRay:
    """``ray.init`` of a loopback-only local cluster for this run, without HTTP servers, with a token of its
    own; the watchdog is started first, so that an interrupt while Ray starts leaves nothing behind either."""
    global _current
    import ray

    env_before = {key: os.environ.get(key) for key in AUTH_ENV}
    token_dir = _run_token()
    _current = LocalRay(None, _start_watchdog(ray_temp_root(), token_dir), token_dir, env_before)
    on_main = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        restore = _loopback_node_address()
        try:
            with _without_http_servers():
                ray.init(num_cpus=num_cpus, runtime_env=runtime_env, include_dashboard=False, log_to_driver=True,
                         configure_logging=False, _system_config={"enable_metrics_collection": False})
        finally:
            restore()
    except BaseException:  # Ctrl-C or a failure while Ray starts: stop what did start, remove its folders
        stop_local_ray()
        raise
    finally:
        if on_main is not None:  # ray.init installs a SIGTERM handler that exits from wherever it lands
            signal.signal(signal.SIGTERM, on_main)
    _current.session_dir = _session_dir()
    return _current


def stop_local_ray() -> None:
    """Shut the run's local Ray down and wait until the watchdog has swept what is left (by process tree and
    by session folder, SIGTERM then SIGKILL) and removed the session folder and the token. A no-op when this
    process started none (a joined cluster, a test's own Ray)."""
    global _current
    import ray

    current, _current = _current, None
    if current is None:
        return
    try:
        ray.shutdown()
    finally:
        if current.watchdog is not None:
            current.watchdog.stdin.close()  # type: ignore[union-attr]
            try:
                current.watchdog.wait(timeout=WATCHDOG_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("the Ray watchdog did not finish within %.0fs; Ray's session folder %s may remain",
                            WATCHDOG_WAIT_S, current.session_dir)
        if current.token_dir is not None:
            shutil.rmtree(current.token_dir, ignore_errors=True)
        for key, value in current.env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ray_temp_root() -> Path:
    """Where Ray puts its session folders (``session_<date>_<driver pid>``): ``$RAY_TMPDIR/ray``, else
    ``$TMPDIR/ray``, else ``/tmp/ray``, as Ray chooses it."""
    try:
        from ray._common.utils import get_default_ray_temp_dir

        return Path(get_default_ray_temp_dir())
    except ImportError:  # pragma: no cover - another Ray layout
        return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"


def _run_token() -> Path | None:
    """Ray's token for this run only: a fresh one in a private folder (0700; the file 0600), named by
    ``RAY_AUTH_TOKEN_PATH`` for Ray's processes. Without it ``ray.init`` writes one to ``~/.ray/auth_token``
    (readable by all, left for good). The environment's own choice (a mode, a token, a path) is kept."""
    if any(os.environ.get(key) for key in AUTH_ENV):
        return None
    folder = Path(tempfile.mkdtemp(prefix="hybridrl-ray-token-"))
    path = folder / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    try:  # the loader caches the token it found (a run before this one in the same process)
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - another Ray layout
        pass
    return folder


@contextmanager
def _without_http_servers() -> Iterator[None]:
    """While ``ray.init`` starts the node: no dashboard head (it serves HTTP even with ``include_dashboard=False``),
    no autoscaler monitor (a Prometheus HTTP endpoint; a fixed local cluster does not scale), and the dashboard
    agent started as in Ray's minimal install, without its HTTP server."""
    try:
        from ray._private import node as ray_node
        from ray._private import utils as ray_utils
    except ImportError:  # pragma: no cover - another Ray layout: its defaults
        log.warning("this Ray version does not let a local cluster start without its HTTP servers")
        yield
        return
    saved = (ray_node.Node.start_api_server, ray_node.Node.start_monitor, ray_utils.get_dashboard_dependency_error)

    def no_api_server(self: Any, **_: Any) -> None:
        self._webui_url = None

    def no_monitor(self: Any) -> None:
        return None

    def minimal() -> ImportError:
        return ImportError("a local hybridrl run starts Ray without HTTP servers")

    ray_node.Node.start_api_server, ray_node.Node.start_monitor = no_api_server, no_monitor
    ray_utils.get_dashboard_dependency_error = minimal
    try:
        yield
    finally:
        ray_node.Node.start_api_server, ray_node.Node.start_monitor, ray_utils.get_dashboard_dependency_error = saved


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


def _start_watchdog(ray_root: Path, token_dir: Path | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "hybridrl.runtime.watchdog", str(os.getpid()), str(ray_root)]
    return subprocess.Popen(args + ([str(token_dir)] if token_dir is not None else []), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
