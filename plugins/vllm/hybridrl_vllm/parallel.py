"""Which ranks of a pool form one vLLM engine replica (engine-free).

A pool of ``world_size`` ranks hosts ``world_size // tp`` replicas; consecutive ranks form one tensor-parallel
group (the layout vLLM builds itself over an existing process group: ``ExternalDP x TP``). The peers of one
replica get the same prompts and sample the same tokens; only the first rank of a replica returns them.
The layout is the core's (``hybridrl.rollout.common.ReplicaLayout``), shared with the other engine backends.
"""

from __future__ import annotations

from hybridrl.rollout.common import ReplicaLayout

__all__ = ["ReplicaLayout"]
