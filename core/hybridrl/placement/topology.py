"""The links between a node's GPUs (NVLink, an NVSwitch fabric, PCIe) as NVML reports them, and between nodes
(the network): what a tensor-parallel all-reduce or a trainer's collectives will travel over.

``read_local_topology`` never fails: without NVML (``pip install nvidia-ml-py``), without GPUs or on any NVML
error it answers an unknown topology, and the checks that read it (``hybridrl.placement.links``) stay silent.
A topology is kept as JSON (``Topology.to_json``), so a recorded one can be checked against on a laptop
(``hybridrl plan --topology FILE``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.placement.plan import Device

#: the kinds of link between two devices; ``self`` is a device with itself (the matrix's diagonal)
NVLINK, NVSWITCH, PCIE, NET, UNKNOWN, SELF = "nvlink", "nvswitch", "pcie", "net", "unknown", "self"
LINK_KINDS = (NVLINK, NVSWITCH, PCIE, NET, UNKNOWN)
#: links a tensor-parallel group or a trainer's collectives run well over
FAST_LINKS = frozenset({NVLINK, NVSWITCH})


class TopologyError(HybridRLError, ValueError):
    """A recorded topology that cannot be read (the message names the file and the key)."""

    exit_status = 2


@dataclass(frozen=True)
class NodeTopology:
    """One node's GPUs: ``links[i][j]`` is the link between its devices ``i`` and ``j`` (``self`` on the diagonal)."""

    links: tuple[tuple[str, ...], ...]
    host: str = ""

    @property
    def devices(self) -> int:
        return len(self.links)

    def link(self, i: int, j: int) -> str:
        if i == j:
            return SELF
        if max(i, j) >= self.devices:
            return UNKNOWN
        return self.links[i][j]

    @classmethod
    def uniform(cls, devices: int, kind: str, host: str = "") -> NodeTopology:
        return cls(tuple(tuple(SELF if i == j else kind for j in range(devices)) for i in range(devices)), host)


@dataclass(frozen=True)
class Topology:
    """The nodes' link matrices, indexed like the plan's logical nodes (``node1:3`` is device 3 of ``nodes[1]``).
    Devices of different nodes talk over the network. ``every_node``: the one node recorded stands for every
    node of the cluster (identical machines)."""

    nodes: tuple[NodeTopology, ...] = ()
    source: str = ""  # where it came from ("NVML on gpu-01", a file), or why it is unknown
    every_node: bool = False

    @classmethod
    def unknown(cls, why: str) -> Topology:
        return cls((), f"unknown: {why}")

    @property
    def known(self) -> bool:
        return any(n.devices for n in self.nodes)

    def node(self, index: int) -> NodeTopology | None:
        if self.every_node and len(self.nodes) == 1:
            return self.nodes[0]
        return self.nodes[index] if index < len(self.nodes) else None

    def link(self, a: Device, b: Device) -> str:
        """The link between two of the plan's devices."""
        if a.node != b.node:
            return NET
        node = self.node(a.node)
        return node.link(a.index, b.index) if node is not None else UNKNOWN

    # --- JSON -------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "every_node": self.every_node,
                "nodes": [{"host": n.host, "links": [list(row) for row in n.links]} for n in self.nodes]}

    @classmethod
    def from_json(cls, data: Any, where: str = "topology") -> Topology:
        """Parse ``to_json``'s form; a bad value is a ``TopologyError`` naming ``where`` and the key."""
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            raise TopologyError(f"{where}: expected an object with a 'nodes' list")
        nodes = []
        for n, node in enumerate(data["nodes"]):
            links = node.get("links") if isinstance(node, dict) else None
            if not isinstance(links, list) or any(not isinstance(row, list) or len(row) != len(links) for row in links):
                raise TopologyError(f"{where}: nodes[{n}].links must be a square list of lists")
            for i, row in enumerate(links):
                for j, kind in enumerate(row):
                    allowed = (SELF,) if i == j else LINK_KINDS
                    if kind not in allowed:
                        raise TopologyError(f"{where}: nodes[{n}].links[{i}][{j}] is {kind!r}, expected one of "
                                            f"{', '.join(allowed)}")
                    if i != j and links[j][i] != kind:
                        raise TopologyError(f"{where}: nodes[{n}].links is not symmetric at [{i}][{j}]")
            nodes.append(NodeTopology(tuple(tuple(row) for row in links), str(node.get("host", ""))))
        return cls(tuple(nodes), str(data.get("source", "")), bool(data.get("every_node", False)))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise TopologyError(f"cannot read the topology file '{path}': {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
        topology = cls.from_json(data, str(path))
        return topology if topology.source else Topology(topology.nodes, f"file {path}", topology.every_node)


# --- reading this machine through NVML ----------------------------------------------------------------

def classify_links(bus_ids: Sequence[Any], nvlink_peers: Sequence[set[Any]], on_switch: Sequence[bool]
                   ) -> tuple[tuple[str, ...], ...]:
    """The link matrix of one node from what NVML says of each GPU: its PCI bus id, the bus ids at the far end of
    its active NVLinks, and whether those links go to an NVSwitch. Two GPUs on one switch fabric: ``nvswitch``;
    an NVLink from one to the other: ``nvlink``; else they share the host's PCIe."""
    n = len(bus_ids)
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append(SELF)
            elif bus_ids[j] in nvlink_peers[i] or bus_ids[i] in nvlink_peers[j]:
                row.append(NVLINK)
            elif on_switch[i] and on_switch[j]:
                row.append(NVSWITCH)
            else:
                row.append(PCIE)
        rows.append(tuple(row))
    return tuple(rows)


def _bus(pci: Any) -> tuple[int, int, int]:
    return int(pci.domain), int(pci.bus), int(pci.device)


def _read_nvml(nvml: Any) -> NodeTopology:
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    bus_ids = [_bus(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
    gpus = set(bus_ids)
    peers: list[set[Any]] = [set() for _ in handles]
    on_switch = [False] * count
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    for i, handle in enumerate(handles):
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _bus(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link))
            except nvml.NVMLError:
                continue  # a link this GPU does not have, or no NVLink at all
            try:
                kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            except (AttributeError, nvml.NVMLError):
                kind = None  # an older NVML: a far end that is not one of this node's GPUs is the switch
            if kind == switch_type or (kind is None and remote not in gpus):
                on_switch[i] = True
            elif remote in gpus:
                peers[i].add(remote)
    return NodeTopology(classify_links(bus_ids, peers, on_switch))


def read_local_topology() -> Topology:
    """This machine's GPU links through NVML (``pynvml``); an unknown topology when NVML is missing or fails, or
    there is no GPU. Never raises."""
    import socket

    try:
        import pynvml as nvml
    except ImportError:
        return Topology.unknown("pynvml is not installed (pip install nvidia-ml-py)")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver, no GPU: the links are unknown, the run goes on
        return Topology.unknown(f"NVML did not start ({exc})")
    try:
        node = _read_nvml(nvml)
    except Exception as exc:  # noqa: BLE001 - the same: never fail a run over a reading
        return Topology.unknown(f"NVML could not read the links ({exc})")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - nothing left to do about it
            pass
    if not node.devices:
        return Topology.unknown("NVML sees no GPU")
    host = socket.gethostname()
    return Topology((NodeTopology(node.links, host),), f"NVML on {host}")
