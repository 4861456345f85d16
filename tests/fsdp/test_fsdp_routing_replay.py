"""MoE routing replay on the FSDP engine: given the experts the HF rollout routed each response token to, the
forward routes those tokens to them on every path (padded, packed, shared prompts), the log-probs come back to
the rollout's, the router still gets gradients, and ``routing_mismatch`` measures what replay corrects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import PolicyGradient, context
from safetensors.torch import load_file, save_file

from hybridrl.config.schema import TinyModelConfig
from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import (
    ADVANTAGES,
    LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    ROUTING_MISMATCH,
    Batch,
    left_pad,
)
from hybridrl.model.tiny import build_tiny_model
from hybridrl.rollout.hf import HFRollout
from hybridrl.rollout.routing import router_modules
from hybridrl_fsdp.engine import FSDPEngine
from hybridrl_fsdp.routing_replay import ROUTING_MISMATCH_METRIC, token_routing

TINY_MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=8, experts_per_token=2, init_std=0.2)
PATHS = [{"packing": False}, {"packing": True, "share_prompts": False}, {"packing": True, "share_prompts": True}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The rollout's model, and the same model with its routers moved a little (the trainer a step ahead)."""
    root = tmp_path_factory.mktemp("replay")
    rollout = build_tiny_model(TINY_MOE, root / "rollout")
    moved = root / "moved"
    moved.mkdir()
    for f in rollout.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(rollout / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = t + 0.3 * t.std() * torch.randn(t.shape, generator=gen)
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    return rollout, moved


@pytest.fixture(scope="module")
def sampled(models: tuple[Path, Path]) -> Batch:
    """Groups of samples from the HF rollout with their routing (prompts repeated: shared-prompt packs)."""
    engine = HFRollout(EngineContext("rollout", "hf", str(models[0]), rank=0, world_size=1))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    ids, mask = left_pad([p for p in prompts for _ in range(3)], pad_id=0)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}, info={"temperature": 1.0})
    batch.update(engine.generate(batch, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3,
                                                       return_routing=True)))
    return batch


def _with(batch: Batch, replay: bool) -> Batch:
    return Batch.from_tensors({**batch.tensors}, info={**batch.info, "routing_replay": replay})


def _experts_seen(engine: FSDPEngine) -> tuple[list[torch.Tensor], list]:
    """Hooks recording the expert ids each experts module is called with (its second argument)."""
    seen: list[torch.Tensor] = []
    experts = [m for m in engine.model.modules() if type(m).__name__.endswith("Experts")]
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for m in experts]
    return seen, handles


def _logp_gap(batch: Batch, log_probs: torch.Tensor) -> float:
    mask = batch["response_mask"].bool()
    return float((log_probs - batch[ROLLOUT_LOG_PROBS]).abs()[mask].mean())


@pytest.mark.parametrize("options", PATHS)
def test_replay_routes_by_the_rollouts_experts(process_group, models, sampled: Batch, options: dict) -> None:
    """Under replay the experts modules get the rollout's ids at every response token the rollout routed, although
    the trainer's own routers (moved) choose otherwise for some."""
    engine = FSDPEngine(context(models[1], micro_batch=len(sampled), **options))
    seen, handles = _experts_seen(engine)
    out = engine.compute_log_probs(_with(sampled, replay=True))
    for h in handles:
        h.remove()
    micro = engine._plan(_with(sampled, replay=True))[0]
    layout = token_routing(micro.batch, micro.packed).experts
    valid = layout[:, 0, 0] >= 0
    assert int(valid.sum()) > 20
    assert len(seen) == layout.shape[1]
    for layer, ids in enumerate(seen):
        assert torch.equal(ids[valid].sort(-1).values, layout[valid, layer].sort(-1).values), layer
    mask = sampled["response_mask"].bool()
    assert float(out[ROUTING_MISMATCH][mask].mean()) > 0  # its own routers would have gone elsewhere


def test_replay_brings_log_probs_back_to_the_rollouts(process_group, models, sampled: Batch) -> None:
    same = FSDPEngine(context(models[0], micro_batch=len(sampled)))
    exact = same.compute_log_probs(_with(sampled, replay=True))
    assert float(exact[ROUTING_MISMATCH].sum()) == 0  # same weights: the same routing
    assert _logp_gap(sampled, exact[LOG_PROBS]) < 1e-4
    moved = FSDPEngine(context(models[1], micro_batch=len(sampled)))
    own = moved.compute_log_probs(_with(sampled, replay=False))
    replayed = moved.compute_log_probs(_with(sampled, replay=True))
    mismatch = own[ROUTING_MISMATCH][sampled["response_mask"].bool()].mean()
    assert mismatch > 0
    assert _logp_gap(sampled, replayed[LOG_PROBS]) < 0.5 * _logp_gap(sampled, own[LOG_PROBS])


def test_mismatch_by_construction(process_group, models, sampled: Batch) -> None:
    """Experts no router would choose together (each token's pair moved by one): every routed token differs."""
    wrong = _with(sampled, replay=False)
    given = wrong[ROUTED_EXPERTS]
    wrong.set(ROUTED_EXPERTS, torch.where(given >= 0, (given + 1) % TINY_MOE.num_experts, given))
    out = FSDPEngine(context(models[0], micro_batch=len(sampled))).compute_log_probs(wrong)
    routed = (given[..., 0, 0] >= 0) & sampled["response_mask"].bool()
    assert torch.equal(out[ROUTING_MISMATCH].bool(), routed)


@pytest.mark.parametrize("options", [PATHS[0], PATHS[2]])
def test_update_under_replay_trains_the_routers(process_group, models, sampled: Batch, options: dict) -> None:
    batch = _with(sampled, replay=True)
    batch.set(ADVANTAGES, torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(1)))
    engine = FSDPEngine(context(models[1], lr=1e-2, micro_batch=3, moe_aux_loss_coef=0.0, **options))
    gates = [r.weight.detach().clone() for r in router_modules(engine.model)]
    metrics = engine.update(batch, PolicyGradient())
    assert 0 < metrics[ROUTING_MISMATCH_METRIC] <= 1
    moved = [float((r.weight.detach() - g).abs().max()) for r, g in zip(router_modules(engine.model), gates)]
    assert min(moved) > 0  # the policy loss reaches the routers through the replayed experts' weights


def test_routing_on_a_dense_model_is_refused(process_group, tiny_model: Path, sampled: Batch) -> None:
    engine = FSDPEngine(context(tiny_model, micro_batch=len(sampled)))
    with pytest.raises(ValueError, match="no MoE router"):
        engine.compute_log_probs(_with(sampled, replay=True))
