"""``cluster.address`` gets one short try: a peer that accepts TCP connections and never answers (a port held by
something that is not a Ray head, a half-dead head) is refused at pre-flight within about 5 s, in one sentence
naming the key, and Ray's own client (about 40 s of retries on such a peer) never runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridrl.runtime.cluster import ADDRESS_TIMEOUT_S, address_problem

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port whose listener accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


ENSURE_RAY = """
import sys, time
import ray
from hybridrl.config import ClusterConfig, ConfigError
from hybridrl.runtime.cluster import ensure_ray
started = time.monotonic()
try:
    ensure_ray(ClusterConfig(address=sys.argv[1]))
except ConfigError as exc:
    print(f"{time.monotonic() - started:.2f}")
    print(exc)
    sys.exit(3 if ray.is_initialized() else 0)
sys.exit(4)
"""


def test_a_listener_that_never_answers_is_refused_within_the_short_try(silent_port: int) -> None:
    # a fresh interpreter: ensure_ray joins a Ray this process may already hold from another test
    proc = subprocess.run([sys.executable, "-c", ENSURE_RAY, f"127.0.0.1:{silent_port}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # 3: ray.init ran after the probe
    took, text = proc.stdout.split("\n", 1)
    assert float(took) <= ADDRESS_TIMEOUT_S + 1.5, took  # Ray's client alone took about 40 s
    assert "cluster.address" in text and f"'127.0.0.1:{silent_port}' does not answer" in text, text
    assert "no Ray head replied there within" in text, text


def test_the_cli_refuses_it_in_one_sentence_and_exits(silent_port: int) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", str(QUICKSTART),
                           f"cluster.address=127.0.0.1:{silent_port}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cluster.address: the address '127.0.0.1:{silent_port}' does not answer (it accepts connections, " \
           "but no Ray head replied there within 5s)" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert took < 40, f"{took:.1f}s"  # start-up and imports included; the probe itself is timed above


def test_a_closed_port_is_still_refused_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert "connection refused" in (address_problem(f"127.0.0.1:{port}") or "")
    assert time.monotonic() - started < 2
