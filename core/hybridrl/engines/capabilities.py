"""What an engine can do beyond its contract's required methods, declared when it is registered
(``registry.add_train_engine(..., supports={"checkpoint", ...}, max_ranks=1)``).

Pre-flight, the trainer and the conformance kit read these declarations from the registry: nothing is found
out by calling a method and catching ``NotImplementedError``, by matching exception text or by importing the
engine in the driver. A declared capability is a promise the kit checks; an undeclared one is never used.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridrl.errors import HybridRLError

#: train engines: capability -> what it promises (and who relies on it).
TRAIN_CAPABILITIES: dict[str, str] = {
    "checkpoint": "save_checkpoint / load_checkpoint (trainer.save_every, resume, export)",
    "greedy_margins": "compute_greedy_margins (trainer.sync_check_every)",
    "value_head": "compute_values with the 'value' head (the critic role)",
    "reward_head": "compute_scores with the 'reward' head (the reward-model role)",
    "offload": "offload / onload move the engine's state off the device and back",
    "lora": "LoRA adapters (EngineContext.lora): trains only them, export_adapter, reference_view (roles.actor.lora)",
    "fused_layer_kernels": "options.fused_kernels: fused RMSNorm / SwiGLU / rotary kernels on CUDA, which keep less "
                           "for backward (the memory plan counts it; auto turns them on)",
    "routing_replay": "an MoE forward (compute_log_probs, update) given routed_experts with "
                      "batch.info['routing_replay'] routes each response token to those experts (router weights "
                      "from its own logits); compute_log_probs returns routing_mismatch (algorithm.routing_replay)",
}
#: rollout engines: capability -> what it promises.
ROLLOUT_CAPABILITIES: dict[str, str] = {
    "sleep": "sleep / wake release and restore device memory (colocated with trainers)",
    "named_weights": "named_weights: the engine's weights under Hugging Face names (weight checks)",
    "requests": "generate_request: single requests served concurrently (multi-turn episodes, one request per turn)",
    "lora_adapters": "import_weights takes LoRA adapters and serves them on the base (roles.actor.lora.sync=adapter)",
    "partial": "generate_until stops once its share of groups is complete and returns the other rows' tokens so far "
               "(roles.rollout.oversample, partial rollouts)",
    "refill": "generate_until(..., running=r) decodes at most ceil(r x groups) groups at once and starts a waiting "
              "group as soon as a running one completes, so its batch never empties into a tail "
              "(roles.rollout.refill)",
    "tensor_parallel": "one engine spans roles.rollout.tensor_parallel consecutive ranks of its pool, its weights "
                       "and KV cache split over them (without it: one engine per rank)",
    "return_routing": "generate with params.return_routing returns routed_experts (B, R, layers, top_k): the experts "
                      "each response token was routed to in every MoE layer, and prompt_routed_experts "
                      "(B, P, layers, top_k) the prompt's at prefill (algorithm.routing_replay)",
}
KNOWN = {"train": TRAIN_CAPABILITIES, "rollout": ROLLOUT_CAPABILITIES}

#: the capability a model head needs from a train backend (``roles.RoleSpec.head``).
HEAD_CAPABILITY = {"value": "value_head", "reward": "reward_head"}


class CapabilityError(HybridRLError, ValueError):
    """A registration declares a capability the core does not know (a typo, most likely)."""

    exit_status = 2  # refused before any work


def check_declared(kind: str, name: str, supports: Iterable[str]) -> frozenset[str]:
    """The declared capabilities as a frozenset; an unknown name is an error that lists the known ones."""
    declared = frozenset(supports)
    unknown = sorted(declared - set(KNOWN[kind]))
    if unknown:
        noun = "capability" if len(unknown) == 1 else "capabilities"
        raise CapabilityError(f"{kind} backend '{name}' declares unknown {noun} "
                              f"{', '.join(map(repr, unknown))} (known: {', '.join(sorted(KNOWN[kind]))})")
    return declared
