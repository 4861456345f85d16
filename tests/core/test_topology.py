"""GPU links (NVLink, NVSwitch, PCIe, the network) checked against the placement: recorded topologies of an
NVSwitch box, a box of NVLink pairs, a PCIe box and two nodes; the warning names the group, its devices and the
link, and stays silent where every pair is joined by NVLink. No GPU is queried: the NVML reading is tested for
its fallback only."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.placement.links import link_warnings, pipeline_groups, render_links, tensor_groups
from hybridrl.placement.plan import ClusterSpec, Device, plan_placement, resolve_backends
from hybridrl.placement.topology import (
    NET,
    NVLINK,
    NVSWITCH,
    PCIE,
    UNKNOWN,
    Topology,
    TopologyError,
    classify_links,
    read_local_topology,
)
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import check_links, local_topology
from hybridrl.runtime.device_map import WorkerLocation, map_rows

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
FIXTURES = Path(__file__).resolve().parent / "topologies"
NVSWITCH_8, PAIRS_8, PCIE_8, TWO_NODES = (FIXTURES / f"{n}.json" for n in
                                          ("nvswitch_8gpu", "nvlink_pairs_8gpu", "pcie_8gpu", "two_nodes_8gpu"))
SPLIT_4_4 = ["pools={train: {nodes: 1, devices_per_node: 4}, gen: {nodes: 1, devices_per_node: 4}}",
             "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]


ONE_BOX = ClusterSpec(1, 8, "cuda", declared=True)


def planned(overrides: list[str], cluster: ClusterSpec = ONE_BOX):
    cfg = load_config(QUICKSTART, overrides)
    backends, problems = resolve_backends(cfg, get_registry(), check_engines=False)
    assert not problems, problems
    return cfg, plan_placement(cfg, cluster, backends)


def warnings_for(fixture: Path, overrides: list[str], cluster: ClusterSpec = ONE_BOX):
    cfg, plan = planned(overrides, cluster)
    return link_warnings(cfg, plan, Topology.load(fixture))


# --- the recorded topologies ---------------------------------------------------------------------------

def test_fixtures_read_back_with_the_links_they_record():
    d = lambda n, i: Device(n, i)  # noqa: E731
    switch, pairs, pcie, two = (Topology.load(f) for f in (NVSWITCH_8, PAIRS_8, PCIE_8, TWO_NODES))
    assert switch.link(d(0, 0), d(0, 7)) == NVSWITCH and pcie.link(d(0, 3), d(0, 4)) == PCIE
    assert pairs.link(d(0, 2), d(0, 3)) == NVLINK and pairs.link(d(0, 1), d(0, 2)) == PCIE
    assert two.link(d(0, 1), d(1, 1)) == NET and two.link(d(1, 0), d(1, 7)) == NVSWITCH
    assert switch.link(d(1, 0), d(1, 1)) == UNKNOWN  # a node the file does not describe
    assert Topology(switch.nodes, every_node=True).link(d(3, 0), d(3, 1)) == NVSWITCH  # one node stands for all
    assert Topology.from_json(json.loads(json.dumps(pairs.to_json()))) == pairs


@pytest.mark.parametrize(("data", "says"), [
    ({"nodes": "x"}, "'nodes' list"),
    ({"nodes": [{"links": [["self", "nvlink"], ["nvlink"]]}]}, "nodes[0].links must be a square"),
    ({"nodes": [{"links": [["self", "infiniband"], ["infiniband", "self"]]}]}, "nodes[0].links[0][1] is 'infiniband'"),
    ({"nodes": [{"links": [["self", "nvlink"], ["pcie", "self"]]}]}, "not symmetric at [0][1]"),
])
def test_a_bad_recorded_topology_names_the_key(tmp_path, data, says):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TopologyError) as err:
        Topology.load(path)
    assert says in str(err.value) and str(path) in str(err.value)


def test_nvml_answers_are_classified_into_links():
    # GPUs 0-1 joined by an NVLink bridge, 2-3 both on a switch, 4 alone on PCIe
    bus = [(0, b, 0) for b in range(5)]
    peers = [{bus[1]}, {bus[0]}, set(), set(), set()]
    links = classify_links(bus, peers, [False, False, True, True, False])
    assert links[0][1] == NVLINK and links[2][3] == NVSWITCH and links[0][2] == PCIE and links[4][3] == PCIE
    assert [links[i][i] for i in range(5)] == ["self"] * 5


def test_reading_without_nvml_answers_unknown_and_never_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    topology = read_local_topology()
    assert not topology.known and "pynvml is not installed" in topology.source

    def broken_init():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=broken_init))
    topology = read_local_topology()
    assert not topology.known and "NVML did not start" in topology.source


def test_local_topology_is_unknown_on_cpu_and_for_declared_clusters():
    assert "CPU slots" in local_topology(ClusterSpec(1, 2, "cpu")).source
    assert "--topology" in local_topology(ClusterSpec(2, 8, "cuda", declared=True)).source


# --- the warnings ------------------------------------------------------------------------------------

def test_nvswitch_box_is_silent_for_tensor_parallel_and_colocated_pools():
    assert warnings_for(NVSWITCH_8, ["pools.main.devices_per_node=8", "roles.rollout.tensor_parallel=8"]) == []
    assert warnings_for(NVSWITCH_8, [*SPLIT_4_4, "roles.rollout.tensor_parallel=4"]) == []


def test_pcie_box_warns_for_the_tensor_parallel_group_and_the_colocated_pool():
    found = warnings_for(PCIE_8, [*SPLIT_4_4, "roles.rollout.tensor_parallel=2"])
    assert len(found) == 2
    tp, pool = found
    assert tp.startswith("rollout (pool 'gen') tensor-parallel (tensor_parallel=2) group ranks 0, 1 "
                         "(node0:4, node0:5) has no NVLink between node0:4 and node0:5 (pcie)")
    assert "(2 of its 2 groups are like it)" in tp
    assert pool.startswith("colocated pool 'train' (actor + ref) has no NVLink between node0:0 and node0:1 (pcie)")


def test_nvlink_pairs_silent_within_a_pair_warn_across_pairs():
    assert warnings_for(PAIRS_8, ["pools.main.devices_per_node=2", "roles.rollout.tensor_parallel=2"]) == []
    two_and_two = ["pools={train: {nodes: 1, devices_per_node: 2}, gen: {nodes: 1, devices_per_node: 2}}",
                   "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]
    assert warnings_for(PAIRS_8, [*two_and_two, "roles.rollout.tensor_parallel=2"]) == []
    found = warnings_for(PAIRS_8, [*SPLIT_4_4, "roles.rollout.tensor_parallel=4"])
    tp = next(w for w in found if "tensor-parallel" in w)
    assert "group ranks 0-3 (node0:4, node0:5, node0:6, node0:7)" in tp
    assert "node0:4 and node0:6 (pcie)" in tp and "node0:4 and node0:5" not in tp  # the NVLink pair is fine
    assert any(w.startswith("colocated pool 'train'") for w in found)


def test_pipeline_stages_are_checked_between_neighbours_in_megatron_order():
    assert tensor_groups(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pipeline_groups(8, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # tp 2, dp 2: stages 4 ranks apart
    megatron = [*SPLIT_4_4, "roles.actor.backend=megatron", "roles.ref.backend=megatron",
                "roles.actor.options={tensor_parallel: 2, pipeline_parallel: 2}"]
    found = warnings_for(PAIRS_8, megatron)
    pp = [w for w in found if "pipeline-parallel" in w]
    assert len(pp) == 1 and "actor (pool 'train') pipeline-parallel (pipeline_parallel=2) group ranks 0, 2 " \
                              "(node0:0, node0:2) has no NVLink between node0:0 and node0:2 (pcie)" in pp[0]
    assert not any("actor (pool 'train') tensor-parallel" in w for w in found)  # ranks 0-1 and 2-3: NVLink pairs


def test_two_nodes_warn_for_a_tensor_parallel_group_across_them_only():
    cluster = ClusterSpec(2, 8, "cuda", declared=True)
    across = ["pools.main.nodes=2", "pools.main.devices_per_node=8"]
    assert warnings_for(TWO_NODES, [*across, "roles.rollout.tensor_parallel=8"], cluster) == []  # one node each
    found = warnings_for(TWO_NODES, [*across, "roles.rollout.tensor_parallel=16"], cluster)
    assert len(found) == 1 and "tensor-parallel (tensor_parallel=16) group ranks 0-15" in found[0]
    assert "node0:0 and node1:0 (net between nodes)" in found[0]


def test_unknown_links_warn_of_nothing():
    cfg, plan = planned([*SPLIT_4_4, "roles.rollout.tensor_parallel=4"])
    assert link_warnings(cfg, plan, Topology.unknown("no NVML")) == []


# --- shown in the device map ------------------------------------------------------------------------

def test_links_are_in_the_printed_map_and_in_device_map_json():
    cfg, plan = planned([*SPLIT_4_4, "roles.rollout.tensor_parallel=2"])
    topology = Topology.load(PAIRS_8)
    assert len(check_links(cfg, plan, topology)) == 1  # the colocated train pool
    text = plan.render()
    assert "links (recorded: 8 GPUs, NVLink bridges" in text
    assert "  pool 'gen' node0:4-7: pcie 4 pair(s), nvlink 2 pair(s)" in text
    assert render_links(plan, Topology.unknown("no NVML")) == "links: unknown: no NVML"
    where = WorkerLocation("n" * 16, "10.0.0.1", ("4",), 1)
    group = SimpleNamespace(plan=plan.group_of("rollout"), locations=[where] * 4)  # what map_rows reads of a group
    rows = map_rows([group], topology)
    assert rows[0]["links"] == {"1": NVLINK, "2": PCIE, "3": PCIE} and rows[2]["links"]["3"] == NVLINK
    assert "links" not in map_rows([group])[0]  # no topology read: the rows as before


def test_cpu_plans_and_declared_clusters_without_a_file_print_no_links():
    cfg, plan = planned(["pools.main.devices_per_node=2"], ClusterSpec(1, 2, "cpu"))
    assert check_links(cfg, plan) == [] and plan.links_table is None and "links" not in plan.render()
    cfg, plan = planned([*SPLIT_4_4, "roles.rollout.tensor_parallel=4"])  # a declared 1x8: nothing read
    assert check_links(cfg, plan) == [] and plan.links_table is None and not plan.topology.known


def test_plan_cli_checks_a_recorded_topology(capsys):
    assert main(["plan", QUICKSTART, *SPLIT_4_4, "roles.rollout.backend=vllm", "roles.rollout.tensor_parallel=2",
                 "--cluster", "1x8", "--topology", str(PCIE_8), "--skip-engine-check"]) == 0
    out = capsys.readouterr().out
    assert "links (recorded: 8 PCIe GPUs, no NVLink):" in out
    assert "WARNING: rollout (pool 'gen') tensor-parallel (tensor_parallel=2) group ranks 0, 1" in out
    assert main(["plan", QUICKSTART, *SPLIT_4_4, "--cluster", "1x8", "--topology", str(NVSWITCH_8)]) == 0
    assert "no NVLink" not in capsys.readouterr().out
    assert main(["plan", QUICKSTART, "--cluster", "1x8", "--topology", str(FIXTURES / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot read the topology file" in err and "Traceback" not in err
