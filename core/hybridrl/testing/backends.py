"""Finding and building the backend under test, as the worker does: registry -> class -> ``EngineContext``.

A backend whose engine package is missing (or whose engine module is registered but not written yet) is
*skipped* with the registry's reason and install hint; an unknown name or a target that is not an engine
class *fails*: those are mistakes, not missing optional packages.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch

from hybridrl.engines import EngineContext, RolloutEngine, TrainEngine, TrainingOptions
from hybridrl.lora import LoraSpec
from hybridrl.plugins.registry import BackendEntry, RegistryError, load_object
from hybridrl.roles import role_spec

Kind = Literal["train", "rollout"]
BASE_CLASS: dict[str, type] = {"train": TrainEngine, "rollout": RolloutEngine}


def registry():
    from hybridrl.plugins.discovery import get_registry

    return get_registry()


def entry(kind: Kind, name: str) -> BackendEntry:
    try:
        return registry().backend(kind, name)
    except RegistryError as exc:
        pytest.fail(f"hybridrl kit: {exc}", pytrace=False)


def engine_class(kind: Kind, name: str) -> type:
    """The registered engine class, or a skip saying why it cannot be used here."""
    found = entry(kind, name)
    problem = found.engine_problem()
    if problem:
        pytest.skip(f"{kind} backend '{name}' (plugin {found.plugin}) is {problem}")
    module = found.target.partition(":")[0] if isinstance(found.target, str) else None
    try:
        cls = load_object(found.target)
    except ModuleNotFoundError as exc:
        if module and exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            pytest.skip(f"{kind} backend '{name}' (plugin {found.plugin}) is registered but its engine module "
                        f"'{exc.name}' does not exist yet")
        raise
    if not (isinstance(cls, type) and issubclass(cls, BASE_CLASS[kind])):
        pytest.fail(f"{kind} backend '{name}': registered target {found.target!r} is not a "
                    f"{BASE_CLASS[kind].__name__} subclass", pytrace=False)
    return cls


def pick_device(kind: Kind, name: str, requested: str | None) -> str:
    """``requested`` (cpu/cuda), or cpu when the backend runs there, else cuda; skips without a GPU. A missing
    engine is reported first (its install hint is the more useful reason)."""
    engine_class(kind, name)
    devices = entry(kind, name).devices
    device = requested if requested and requested != "auto" else ("cpu" if "cpu" in devices else "cuda")
    if device not in devices:
        pytest.skip(f"{kind} backend '{name}' runs on {', '.join(devices)}, not {device}")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{kind} backend '{name}' needs a CUDA device and none is visible")
    return device


def ensure_process_group(device: str) -> None:
    """A one-rank default process group, as every hybridrl worker has (gloo on CPU, NCCL on CUDA). One made
    earlier in this process is reused; a multi-rank one means the kit cannot run here."""
    import torch.distributed as dist

    from hybridrl.runtime.distributed import free_port, init_process_group

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-rank torch.distributed group is already initialised in this process")
        return
    init_process_group(0, 1, "127.0.0.1", free_port(), device)


def role_options(role: str, **overrides: Any) -> dict[str, Any]:
    """The options a real run hands the role's engine (the typed role keys with their defaults, see
    ``hybridrl.runtime.launch.role_options``), with ``overrides`` on top."""
    from hybridrl.config import ActorConfig, RefConfig, RolloutConfig
    from hybridrl.config.schema import CriticConfig, RewardModelConfig

    if role == "reward":  # the reward role's engine options are those of its model (runtime.launch.role_options)
        options = RewardModelConfig.model_construct().model_dump(exclude={"path", "tiny", "coef"})
    else:
        model = {"actor": ActorConfig, "ref": RefConfig, "rollout": RolloutConfig, "critic": CriticConfig}[role]
        # the value loss's keys are the driver's (the objective), not the engine's
        options = model.model_construct().model_dump(exclude={"pool", "backend", "options", "model_path",
                                                               "cliprange_value", "loss_agg"})
    options.update(overrides)
    return {k: v for k, v in options.items() if v is not None}


def engine_context(kind: Kind, name: str, model_path: str, device: str, dtype: str = "float32",
                   role: str | None = None, options: dict[str, Any] | None = None,
                   lora: LoraSpec | None = None) -> EngineContext:
    """The ``EngineContext`` of rank 0 of 1, as the worker makes it for ``role`` (``lora``: the run's adapters)."""
    role = role or ("actor" if kind == "train" else "rollout")
    if kind == "train":
        training, own = TrainingOptions.split(options or {})
    else:
        training, own = TrainingOptions(), dict(options or {})
    return EngineContext(role=role, backend=name, model_path=str(model_path), rank=0, world_size=1, device=device,
                         dtype=dtype, seed=0, trainable=role_spec(role).trainable, options=own, training=training,
                         lora=lora)


def build_engine(kind: Kind, name: str, model_path: str, device: str, dtype: str = "float32",
                 role: str | None = None, options: dict[str, Any] | None = None,
                 lora: LoraSpec | None = None) -> Any:
    """Construct the backend's engine for one rank of one, inside a one-rank process group."""
    cls = engine_class(kind, name)
    ensure_process_group(device)
    return cls(engine_context(kind, name, model_path, device, dtype, role, options, lora))
