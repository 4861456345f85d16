"""Megatron's ``parallel_state`` on top of the default process group the hosting worker made.

``parallel_state`` is global to a process, so every Megatron engine in one process (an actor and its fused
reference policy) shares one tensor/pipeline/expert layout. Expert parallelism (``ep``) splits a
mixture-of-experts model's experts over ``ep`` ranks of each data-parallel group (Megatron carves the expert
groups out of the data-parallel ranks: ``ep`` must divide ``dp``); the experts' gradients are averaged over the
expert-data-parallel group, the ranks holding the same experts. An engine that names no layout takes the one already
there; one that names a different layout is refused with the reason, instead of silently re-wiring the
groups under the other engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridrl_megatron.settings import layout_problem

#: the default process group the current parallel state was built on (a new default group invalidates it).
_built_on: Any = None


@dataclass(frozen=True)
class Layout:
    """This rank's place in the tensor x data x pipeline grid and the groups it talks over."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any  # tensor x pipeline: the ranks that together hold one copy of the model
    embedding_group: Any  # first and last stage (tied embeddings under pipeline parallelism), else None
    pp_ranks: tuple[int, ...]  # global rank of each stage of this rank's pipeline
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None  # the ranks that together hold every expert
    expert_dp: int = 1
    expert_dp_group: Any = None  # the ranks holding the same experts (their gradients are averaged)
    ep_ranks: tuple[int, ...] = (0,)  # global rank of each expert-parallel rank of this rank's group

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def _current_sizes() -> tuple[int, int, int] | None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or _built_on is not dist.distributed_c10d._get_default_group():
        return None
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())


def init_parallel(world_size: int, tp: int | None, pp: int | None, ep: int | None = None) -> Layout:
    """Initialise (or reuse) Megatron's parallel state for ``tp`` x ``pp`` with ``ep`` expert-parallel ranks
    (None: keep the current one, or 1)."""
    from megatron.core import parallel_state as ps

    global _built_on
    current = _current_sizes()
    if current is not None:
        want = (tp or current[0], pp or current[1], ep or current[2])
        if want != current:
            raise RuntimeError(
                f"this process already runs Megatron with tensor_parallel={current[0]}, pipeline_parallel="
                f"{current[1]}, expert_parallel={current[2]}; Megatron roles fused into one process must share the "
                f"layout, but this role asks for tensor_parallel={want[0]}, pipeline_parallel={want[1]}, "
                f"expert_parallel={want[2]} (set the same options on every Megatron role of the pool, or leave them "
                "unset on the reference policy)")
    else:
        tp, pp, ep = tp or 1, pp or 1, ep or 1
        problem = layout_problem(world_size, tp, pp, ep)
        if problem:
            raise ValueError(problem)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()  # built on a default group that no longer exists
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep,
                                     create_gloo_process_groups=False)  # only the distributed optimiser uses them
        _built_on = dist.distributed_c10d._get_default_group()
    return current_layout()


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    pp = ps.get_pipeline_model_parallel_world_size()
    return Layout(
        tp=ps.get_tensor_model_parallel_world_size(), pp=pp, dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group(), pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(), mp_group=ps.get_model_parallel_group(),
        embedding_group=ps.get_embedding_group(check_initialized=False) if pp > 1 else None,
        pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(), expert_dp=ps.get_expert_data_parallel_world_size(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        ep_ranks=tuple(dist.get_process_group_ranks(ps.get_expert_model_parallel_group())),
    )
