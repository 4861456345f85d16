"""``hybridrl cluster`` without starting a node: the addresses it refuses, the interface the collectives take,
a worker or a driver without a head, and that ``down`` only signals the processes it started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import psutil
import pytest

from hybridrl.cli import main
from hybridrl.runtime import ray_nodes


def test_addresses_ray_would_replace_or_that_no_interface_holds_are_refused():
    for name in ("localhost", "127.0.0.1"):
        with pytest.raises(ray_nodes.ClusterError, match="its own loopback address"):
            ray_nodes.check_node_ip(name)
    with pytest.raises(ray_nodes.ClusterError, match="no interface of this machine holds"):
        ray_nodes.check_node_ip("203.0.113.7")  # TEST-NET-3: on no interface here
    ray_nodes.check_node_ip("127.0.0.3")  # Linux routes all of 127/8 to lo


def test_the_collectives_take_the_interface_of_the_node_address(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert ray_nodes.collective_env("127.0.0.3") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stays
    assert ray_nodes.collective_env("127.0.0.3")["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_worker_or_a_driver_without_a_head_is_told_how_to_start_one(tmp_path, capsys):
    assert main(["cluster", "env", "--dir", str(tmp_path)]) == 2
    assert "no cluster in" in capsys.readouterr().err
    assert main(["cluster", "up", "--node-ip", "127.0.0.3", "--dir", str(tmp_path)]) == 2
    assert "hybridrl cluster up --head" in capsys.readouterr().err
    assert main(["cluster", "up", "--head", "--address", "10.0.0.1:6379", "--dir", str(tmp_path)]) == 2


def test_the_ray_session_folder_is_short_and_node_local(tmp_path):
    deep = tmp_path / ("x" * 80) / "cluster"
    path = ray_nodes.ray_temp_dir(deep, "worker-127.0.0.3-1796131321892")
    assert len(path) < 40 and str(tmp_path) not in path
    assert path != ray_nodes.ray_temp_dir(deep, "worker-127.0.0.4-1796131321892")


def test_down_stops_the_recorded_process_and_never_a_reused_pid(tmp_path):
    folder = tmp_path / "cluster"
    (folder / "nodes").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        started = psutil.Process(proc.pid).create_time()
        mine = ray_nodes.NodeRecord(False, "127.0.0.2:1", "127.0.0.3", socket.gethostname(), proc.pid, started,
                                    "log", str(tmp_path / "ray-temp"))
        reused = ray_nodes.NodeRecord(False, "127.0.0.2:1", "127.0.0.4", socket.gethostname(), os.getpid(),
                                      started - 1000, "log", str(tmp_path / "other"))  # our pid, another start
        (folder / "nodes" / "a.json").write_text(json.dumps(asdict(mine)))
        (folder / "nodes" / "b.json").write_text(json.dumps(asdict(reused)))
        stopped = ray_nodes.stop_nodes(folder)
        assert {r.node_ip for r in stopped} == {"127.0.0.3", "127.0.0.4"}
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is not None  # the recorded process was stopped; this test process still runs
        assert not ray_nodes.node_records(folder)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
