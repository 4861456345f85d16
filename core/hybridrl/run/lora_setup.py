"""What pre-flight checks and resolves of ``roles.actor.lora`` (``hybridrl.lora``), before any process starts.

* The actor's backend must declare the ``lora`` capability, and a rollout that is sent the adapters alone
  (``sync: adapter``) the ``lora_adapters`` one.
* ``target_modules`` must name linear layers of the model (read on the meta device: no weights loaded).
* ``sync: auto`` is resolved from the placement (``hybridrl.lora.resolve_sync``) and written into the run's
  config, with a note; so is where the reference comes from.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config import RunConfig
from hybridrl.lora import ALL_LINEAR, ROLLOUT_CAPABILITY, TRAIN_CAPABILITY, reference_is_actor_base, resolve_sync

Problems = list[tuple[str, str]]


def lora_problems(cfg: RunConfig, backends: dict[str, Any]) -> Problems:
    """The backends a LoRA run needs (``backends``: role -> ``BackendEntry``)."""
    lora = cfg.roles.actor.lora
    if lora is None:
        return []
    problems: Problems = []
    actor, rollout = backends.get("actor"), backends.get("rollout")
    if actor is not None and not actor.can(TRAIN_CAPABILITY):
        problems.append(("roles.actor.lora", f"the actor's backend '{actor.name}' does not train LoRA adapters "
                                             f"(backends that do declare the '{TRAIN_CAPABILITY}' capability, e.g. "
                                             "fsdp)"))
    if lora.sync == "adapter" and rollout is not None and not rollout.can(ROLLOUT_CAPABILITY):
        problems.append(("roles.actor.lora.sync", f"the rollout backend '{rollout.name}' cannot be sent adapters "
                                                  "alone (it does not declare 'lora_adapters'): use sync=merged"))
    return problems


def with_lora(cfg: RunConfig, plan: Any, backends: dict[str, Any]) -> tuple[RunConfig, list[str]]:
    """The config with ``roles.actor.lora.sync`` resolved, and the notes that say what LoRA does in this run."""
    lora = cfg.roles.actor.lora
    if lora is None or plan is None:
        return cfg, []
    rollout = backends.get("rollout")
    serves = rollout is not None and rollout.can(ROLLOUT_CAPABILITY)
    sync, why = resolve_sync(lora.sync, plan.same_process("actor", "rollout"), serves)
    notes = []
    if lora.sync == "auto":
        notes.append(f"auto: roles.actor.lora.sync={sync} ({why})")
    actor = cfg.roles.actor.model_copy(update={"lora": lora.model_copy(update={"sync": sync})})
    cfg = cfg.model_copy(update={"roles": cfg.roles.model_copy(update={"actor": actor})})
    if reference_is_actor_base(cfg, plan):
        notes.append("roles.ref: the LoRA actor's base with its adapters disabled, in the actor's process (no copy "
                     "of the weights)")
    elif cfg.roles.ref is not None and "ref" in plan.role_pool:
        notes.append("roles.ref: loads the base model itself (it does not share the LoRA actor's process)")
    return cfg, notes


def target_problems(cfg: RunConfig) -> Problems:
    """``target_modules`` that name no linear layer of the policy (its architecture built on the meta device)."""
    lora = cfg.roles.actor.lora
    if lora is None or lora.target_modules == ALL_LINEAR:
        return []
    try:
        names = linear_module_names(_policy_config(cfg))
    except (OSError, ValueError, KeyError, ImportError):
        return []  # an unreadable model is reported by the model checks
    missing = [t for t in lora.target_modules if t not in names]
    if not missing:
        return []
    return [("roles.actor.lora.target_modules", f"no linear layer named {', '.join(map(repr, missing))} in the "
                                                f"model (its linear layers: {', '.join(sorted(names))})")]


def linear_module_names(config: Any) -> set[str]:
    """The last name component of every ``nn.Linear`` of the causal LM ``config`` builds (the output head too)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _policy_config(cfg: RunConfig) -> Any:
    from transformers import AutoConfig

    if cfg.model.tiny is not None:
        from hybridrl.model.tiny import tiny_hf_config

        return tiny_hf_config(cfg.model.tiny)
    return AutoConfig.from_pretrained(cfg.model.path)


def resume_problems(folder: Any, cfg: RunConfig) -> Problems:
    """A checkpoint of a LoRA actor holds its adapters only, a full one the whole model: the run must train what
    the checkpoint holds, with adapters of the same rank on the same modules."""
    from hybridrl.run.compat import read_summary

    try:
        saved = (read_summary(folder).get("actor_options") or {}).get("lora")
    except (OSError, ValueError):
        return []  # an unreadable summary is reported by the other resume checks
    now = cfg.roles.actor.lora
    if saved is None and now is None:
        return []
    if saved is None or now is None:
        held, wanted = ("full weights", "LoRA adapters") if saved is None else ("LoRA adapters", "full weights")
        return [("trainer.resume", f"checkpoint '{folder}' holds an actor trained with {held}, this run trains "
                                   f"{wanted} (roles.actor.lora); resume it with the same setting, or start a new run")]
    keys = [k for k in ("rank", "target_modules") if saved.get(k) != getattr(now, k)]
    if keys:
        diff = ", ".join(f"{k} {saved.get(k)!r} there, {getattr(now, k)!r} here" for k in keys)
        return [("trainer.resume", f"checkpoint '{folder}' holds LoRA adapters of another layout ({diff})")]
    return []
