"""The candidate device maps of a cluster, each a list of dotted overrides of the user's config.

Over ``nodes x devices``: everything colocated on every device, synchronous and with groups in flight
(``trainer.mode=async``: partial rollouts, a backend declaring ``partial``); the same devices shared by a train
pool and a rollout pool, both resident, pipelined (fractional, ``pools.gen.share``); the actor (and reference,
critic, reward model) split from the rollout at a few gen:train ratios (inside each node, or by whole nodes); with
a reference, the same splits with the reference on a pool of its own, and so with a critic and a reward model;
each split map also pipelined (``trainer.pipelined``, staleness 1); and each map with the rollout's tensor
parallelism 1, 2, 4 ... up to the rollout's devices on a node (1 only for a backend that runs one engine per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config import RunConfig

#: the shares of a node's devices (or of the nodes) given to generation in the split maps
GEN_SHARES = (0.25, 0.5, 0.75)
#: pool names of the candidate maps
MAIN, TRAIN, GEN, REF, CRITIC, REWARD = "main", "train", "gen", "ref", "critic", "reward"


@dataclass(frozen=True)
class Candidate:
    """One device map: ``pools`` name -> (nodes, devices per node), the rollout's tensor parallelism, and the
    overrides that make the user's config use it."""

    name: str
    kind: str  # "colocated", "in_flight", "fractional", "split" or "pipelined"
    pools: tuple[tuple[str, int, int], ...]
    tp: int
    overrides: tuple[str, ...]

    def devices(self, pool: str) -> int:
        return next(n * d for p, n, d in self.pools if p == pool)


def _tps(devices_per_node: int, shards: bool = True) -> list[int]:
    return [tp for tp in (1, 2, 4, 8) if tp <= devices_per_node and devices_per_node % tp == 0 and (shards or tp == 1)]


def _overrides(cfg: RunConfig, pools: list[tuple[str, int, int]], placement: dict[str, str], tp: int,
               pipelined: bool, shares: dict[str, str] | None = None, in_flight: bool = False) -> tuple[str, ...]:
    """The keys that turn ``cfg`` into the map. The trainer's mode is always set: a config that spells
    ``trainer.mode`` (a run's resolved ``config.json``) would otherwise refuse a pipelined map, or make a
    colocated map an in-flight one."""
    names = [p for p, _, _ in pools]
    out = [f"pools.{p}=null" for p in cfg.pools if p not in names]
    for pool, nodes, per_node in pools:
        out += [f"pools.{pool}.nodes={nodes}", f"pools.{pool}.devices_per_node={per_node}"]
    out += [f"pools.{pool}.share={host}" for pool, host in (shares or {}).items()]
    out += [f"roles.{role}.pool={pool}" for role, pool in placement.items()]
    out.append(f"roles.rollout.tensor_parallel={tp}")
    out.append(f"trainer.pipelined={'true' if pipelined else 'false'}")
    out.append(f"trainer.mode={'async' if pipelined or in_flight else 'sync'}")
    if pipelined:
        out.append("trainer.max_staleness=1")
    return tuple(out)


def candidate_maps(cfg: RunConfig, nodes: int, per_node: int, rollout_tp: bool = True) -> list[Candidate]:
    """Every candidate map of ``cfg`` over ``nodes x per_node`` devices (see the module docstring);
    ``rollout_tp``: whether the rollout backend splits an engine over ranks."""
    roles = list(cfg.role_configs())
    own_pools = [(role, pool) for role, pool in (("ref", REF), ("critic", CRITIC), ("reward", REWARD))
                 if role in roles]
    out: list[Candidate] = []
    colocated = [(MAIN, nodes, per_node)]
    for tp in _tps(per_node, rollout_tp):
        suffix = f" tp{tp}" if tp > 1 else ""
        placement = {r: MAIN for r in roles}
        out.append(Candidate(f"colocated {nodes}x{per_node}{suffix}", "colocated", tuple(colocated), tp,
                             _overrides(cfg, colocated, placement, tp, False)))
        out.append(Candidate(f"in-flight {nodes}x{per_node}{suffix}", "in_flight", tuple(colocated), tp,
                             _overrides(cfg, colocated, placement, tp, False, in_flight=True)))
    fractional = [(TRAIN, nodes, per_node), (GEN, nodes, per_node)]  # the rollout beside the trainers, pipelined
    for tp in _tps(per_node, rollout_tp):
        out.append(Candidate(f"fractional {nodes}x{per_node}" + (f" tp{tp}" if tp > 1 else ""), "fractional",
                             tuple(fractional), tp,
                             _overrides(cfg, fractional, {r: (GEN if r == "rollout" else TRAIN) for r in roles}, tp,
                                        True, {GEN: TRAIN})))
    splits: list[tuple[tuple[int, int], tuple[int, int]]] = []  # ((train nodes, per node), (gen nodes, per node))
    for k in sorted({int(per_node * s) for s in GEN_SHARES} - {0, per_node}):
        splits.append(((nodes, per_node - k), (nodes, k)))
    if nodes > 1:
        for j in sorted({round(nodes * s) for s in GEN_SHARES} - {0, nodes}):
            splits.append(((nodes - j, per_node), (j, per_node)))
    for (tn, td), (gn, gd) in splits:
        layouts = [([(TRAIN, tn, td), (GEN, gn, gd)], {r: (GEN if r == "rollout" else TRAIN) for r in roles})]
        for role, own in own_pools:  # the reference, the critic or the reward model on half the train devices
            if td >= 2:
                rd = td // 2
                layouts.append(([(TRAIN, tn, td - rd), (own, tn, rd), (GEN, gn, gd)],
                                {r: (GEN if r == "rollout" else own if r == role else TRAIN) for r in roles}))
        for pools, placement in layouts:
            label = ":".join(f"{p} {n}x{d}" for p, n, d in pools)
            for tp in _tps(gd, rollout_tp):
                suffix = f" tp{tp}" if tp > 1 else ""
                for pipelined in (False, True):
                    kind = "pipelined" if pipelined else "split"
                    out.append(Candidate(f"{kind} {label}{suffix}", kind, tuple(pools), tp,
                                         _overrides(cfg, pools, placement, tp, pipelined)))
    return out
