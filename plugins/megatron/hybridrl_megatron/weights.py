"""Full HF-named tensors out of a tensor/pipeline-parallel Megatron model, for the reshard bridge.

Every rank walks the same list: stage by stage, parameter by parameter. The ranks of the owning stage
all-gather the tensor-parallel shards into the full Megatron tensor and split it into its HF parts; with
pipeline parallelism each part is then broadcast once from the owning stage to the other stages of the
pipeline (receive buffers are sized from the model spec). A mixture-of-experts model's experts live on one
rank of each expert-parallel group: the owner broadcasts each of its experts' HF parts over that group first.
So every rank ends with every full tensor: a colocated rollout on any rank can import them, and the
object-store bridge takes rank 0's.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from hybridrl_megatron.convert import ModelSpec, ep_owner, from_mcore, hf_shapes, is_vocab_parallel, merge_tp
from hybridrl_megatron.model import ParamEntry, stage_names
from hybridrl_megatron.parallel import Layout


def gather_tp(entry: ParamEntry, layout: Layout, vocab_size: int) -> torch.Tensor:
    """The full Megatron tensor of one parameter (padded vocabulary rows dropped); a copy, never a view."""
    local = entry.param.detach()
    if layout.tp == 1:
        full = local.clone()
    else:
        shards = [torch.empty_like(local) for _ in range(layout.tp)]
        dist.all_gather(shards, local.contiguous(), group=layout.tp_group)
        full = merge_tp(entry.name, shards)
    return full[:vocab_size].clone() if is_vocab_parallel(entry.name) else full


def iter_full_hf(table: list[ParamEntry], spec: ModelSpec, layout: Layout, dtype: torch.dtype,
                 device: torch.device, head: str = "lm") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the whole model on every rank, in a fixed order (collective)."""
    mine = {e.name: e for e in table if not e.tied_copy}
    for stage in range(layout.pp):
        src = layout.pp_ranks[stage]
        for name in stage_names(spec, layout, stage, head):
            owner = ep_owner(spec, name, layout.ep) if spec.is_moe else None
            if stage == layout.pp_rank and name in mine:
                full = gather_tp(mine[name], layout, spec.vocab_size)
                parts = [(n, t.contiguous()) for n, t in from_mcore(name, full, spec)]
            else:
                parts = [(n, torch.empty(shape, dtype=dtype, device=device)) for n, shape in hf_shapes(spec, name)]
            for hf_name, tensor in parts:
                if owner is not None and layout.ep > 1 and stage == layout.pp_rank:
                    dist.broadcast(tensor, src=layout.ep_ranks[owner], group=layout.ep_group)
                if layout.pp > 1:
                    dist.broadcast(tensor, src=src, group=layout.pp_group)
                yield hf_name, tensor
