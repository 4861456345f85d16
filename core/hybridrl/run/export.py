"""``hybridrl export RUN``: the actor of a checkpoint as a Hugging Face model folder (config, tokenizer,
safetensors) that ``AutoModelForCausalLM.from_pretrained`` loads; for a LoRA actor the base with the adapters
merged in, or with ``--adapter`` the adapters alone as a peft adapter folder (``adapter_config.json``,
``adapter_model.safetensors``, the tokenizer) that ``peft.PeftModel.from_pretrained`` loads onto the run's base.

The checkpoint's format belongs to its train backend, so the export does not read it directly: it builds
the actor's engine on one CPU rank in this process, has it load the checkpoint (the backend reshards, e.g.
DCP for FSDP), and writes what ``export_weights`` yields, the same full HF-named tensors the reshard bridge
sends to the rollout. The tokenizer and generation config are copied from the model the run started from.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from hybridrl.errors import HybridRLError
from hybridrl.lora import LoraSpec, pair_adapters, target_names, write_adapter
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.atomic_dir import replaced_atomically
from hybridrl.run.faults import not_writable

logger = logging.getLogger(__name__)

#: files of the source model folder that are not copied (the weights and config are written anew).
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class ExportError(HybridRLError, RuntimeError):
    """The checkpoint cannot be exported (missing, saved by another layout, weights that do not fit)."""

    exit_status = 2  # refused before any work


#: written into every export; marks a folder that ``--force`` may replace.
EXPORT_MARKER = "hybridrl_export.json"


def export_checkpoint(run: str | Path, out: str | Path, step: int | None = None, dtype: str | None = None,
                      force: bool = False, adapter: bool = False, unverified: bool = False) -> Path:
    """Write the actor of ``run``'s checkpoint of ``step`` (default: the latest) to ``out`` as an HF model
    (``adapter``: its LoRA adapters as a peft adapter). ``run`` is a run folder (``trainer.out``) or a checkpoint
    folder; ``dtype`` defaults to the run's ``model.dtype``. ``out`` must not exist or be empty, or (with
    ``force``) hold a previous export; it is checked before anything is loaded. A checkpoint without a manifest
    is refused unless ``unverified`` (``--unverified``), and so is a run folder a live run holds. Returns
    ``out``."""
    from hybridrl.run.run_lock import refuse_if_live

    run = Path(run)
    run_folder = run.parent.parent if ckpt.is_complete(run) else run
    problem = refuse_if_live(run_folder, "its checkpoints may change while they are read; export once it has ended") \
        or refuse_if_live(Path(out), "an export into it would mix with that run") \
        or export_target_problem(run_folder, Path(out), force)
    if problem:
        raise ExportError(problem)
    folder = _checkpoint_folder(run, step, unverified)
    summary = json.loads((folder / ckpt.DRIVER_SUMMARY).read_text())
    backend = summary.get("roles", {}).get("actor")
    if backend is None or not (folder / "actor").is_dir():
        raise ExportError(f"checkpoint '{folder}' holds no actor state")
    model_path = Path(summary["model_path"])
    if not (model_path / "config.json").is_file():
        raise ExportError(f"the run's model folder '{model_path}' (config and tokenizer) is gone")
    settings, backend_options = saved_actor_settings(summary)
    target = getattr(torch, dtype or summary.get("dtype", "float32"))
    meta = {"source": str(folder), "step": summary["step"], "backend": backend}
    if adapter:
        spec = LoraSpec.from_config(settings.get("lora"))
        if spec is None:
            raise ExportError(f"checkpoint '{folder}' holds a full actor, not LoRA adapters (roles.actor.lora): "
                              "export it without --adapter")
        tensors = actor_weights(folder / "actor", backend, str(model_path), settings, backend_options,
                                adapter=True)
        return write_adapter_folder(tensors, spec, model_path, Path(out), target, {**meta, "adapter": True})
    weights = actor_weights(folder / "actor", backend, str(model_path), settings, backend_options)
    return write_hf_model(weights, model_path, Path(out), target, meta)


def _checkpoint_folder(run: Path, step: int | None, unverified: bool = False) -> Path:
    """The checkpoint to export, verified against its manifest: the one named, or the newest intact one of
    the run (a damaged latest one is passed over with a warning). ``unverified`` trusts one without a
    manifest."""
    if ckpt.is_complete(run):
        if step is not None and summary_step(run) != step:
            raise ExportError(f"'{run}' is the checkpoint of step {summary_step(run)}, not {step}")
        folder = run
    elif step is None:
        folder, passed = ckpt.newest_intact(run, allow_unverified=unverified)
        for skipped, why in passed:
            logger.warning("export: skipped the damaged checkpoint %s: %s", skipped, why)
        if folder is None:
            raise ExportError(f"no intact checkpoint under '{ckpt.checkpoints_root(run)}'"
                              + ("" if passed else " (no complete one)"))
        return folder
    else:
        try:
            folder = ckpt.find_checkpoint(run, step)
        except ckpt.CheckpointError as exc:
            raise ExportError(str(exc)) from None
    why = ckpt.damage(folder, allow_unverified=unverified)
    if why == ckpt.UNVERIFIED:
        raise ExportError(f"checkpoint '{folder}' cannot be trusted: {ckpt.MANIFEST} is missing, so its files "
                          "cannot be checked against what was saved; pass --unverified to export it anyway")
    if why:
        raise ExportError(f"checkpoint '{folder}' is damaged: {why}")
    return folder


def export_target_problem(run: Path, out: Path, force: bool) -> str | None:
    """Why ``out`` may not receive an export of the run in folder ``run`` (None: it may). Like ``git clone``,
    an export refuses a folder that is not empty, and ``force`` replaces only a previous export: never the
    run, a folder holding it, or anything inside its checkpoints."""
    target, run = out.resolve(), run.resolve()
    checkpoints = ckpt.checkpoints_root(run)
    if target.exists() and not target.is_dir():
        return f"--out '{out}' exists and is not a folder"
    if target == run or run.is_relative_to(target):
        return f"--out '{out}' is the run folder '{run}' or holds it; export to a folder of its own"
    if target.is_relative_to(checkpoints):
        return f"--out '{out}' is inside the run's checkpoints ('{checkpoints}'); export to a folder of its own"
    unwritable = not_writable(target.parent)
    if unwritable:
        return f"--out '{out}': {unwritable}"
    if not target.is_dir() or not any(target.iterdir()):
        return None
    if not (target / EXPORT_MARKER).is_file():
        return (f"--out '{out}' is not empty and holds no previous export ({EXPORT_MARKER}); "
                "export to a new or empty folder")
    if not force:
        return f"--out '{out}' holds a previous export: pass --force to replace it"
    return None


def summary_step(folder: Path) -> int:
    return int(json.loads((folder / ckpt.DRIVER_SUMMARY).read_text())["step"])


def saved_actor_settings(summary: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the actor's role settings, its backend's own options)`` as the run saved them. Checkpoints written
    before the two were kept apart hold only the flat settings: the backend's options are then what is not a
    typed key of ``roles.actor``."""
    from hybridrl.config.schema import ActorConfig

    settings = summary.get("actor_options", {})
    if "actor_backend_options" in summary:
        return settings, summary["actor_backend_options"]
    return settings, {k: v for k, v in settings.items() if k not in ActorConfig.model_fields}


def actor_weights(state_dir: Path, backend: str, model_path: str, settings: dict[str, Any],
                  backend_options: dict[str, Any], adapter: bool = False) -> dict[str, torch.Tensor]:
    """Full HF-named CPU tensors of the actor saved in ``state_dir``: its engine built on one CPU rank (in a
    one-rank gloo group of this process), loaded, exported (a LoRA actor: merged; ``adapter``: its adapters
    alone, under peft's names)."""
    import torch.distributed as dist

    from hybridrl.engines import EngineContext, TrainingOptions
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.run.trusted_files import UntrustedFileError
    from hybridrl.runtime.distributed import free_port, init_process_group

    engine_cls = get_registry().backend("train", backend).load()
    own_group = not dist.is_initialized()
    if own_group:
        init_process_group(0, 1, "127.0.0.1", free_port(), "cpu")
    elif dist.get_world_size() != 1:
        raise ExportError("export runs on one rank, but this process is in a multi-rank process group")
    try:
        training, _ = TrainingOptions.split(settings)
        ctx = EngineContext(role="actor", backend=backend, model_path=model_path, rank=0, world_size=1, device="cpu",
                            dtype="float32", trainable=False, options=dict(backend_options), training=training,
                            lora=LoraSpec.from_config(settings.get("lora")))
        try:
            engine = engine_cls(ctx)
        except ValueError as exc:  # a layout one rank cannot hold (Megatron's tensor/pipeline parallel ...)
            raise ExportError(f"the '{backend}' actor of this run cannot be built on one CPU rank for the export "
                              f"({exc}); its checkpoint loads only on the layout it was saved with") from None
        try:
            engine.load_checkpoint(str(state_dir))
        except UntrustedFileError as exc:  # checked before, by damage(): a file changed since
            raise ExportError(str(exc)) from None
        except NotImplementedError as exc:
            raise ExportError(f"the '{backend}' backend cannot load checkpoints: {exc}") from None
        except ValueError as exc:  # e.g. a layout (tensor parallel ...) that one rank cannot take
            raise ExportError(f"the '{backend}' checkpoint in '{state_dir}' does not load on one CPU rank: "
                              f"{exc}") from None
        buckets = engine.export_adapter(1 << 28) if adapter else engine.export_weights(1 << 28)
        return {n: t.detach().to("cpu", copy=True) for bucket in buckets for n, t in bucket}
    finally:
        if own_group:
            dist.destroy_process_group()


def write_hf_model(weights: dict[str, torch.Tensor], model_path: Path, out: Path, dtype: torch.dtype,
                   meta: dict[str, Any]) -> Path:
    """``weights`` into the architecture of ``model_path`` (checked: every parameter given, nothing extra,
    tied heads aside), saved with ``save_pretrained`` next to copies of its tokenizer files; written to a
    temporary folder and renamed, so ``out`` is never half-written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridrl.weights.experts import fuse_experts

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = set(model.state_dict())
    weights = fuse_experts(weights, expected)  # MoE experts come per expert; the model may hold them fused
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(expected - set(weights) - tied)
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise ExportError(f"the checkpoint's weights do not fit {type(model).__name__}: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    model.load_state_dict(weights, strict=False, assign=True)
    if tied:
        model.tie_weights()
    model = model.to(dtype)
    out = out.resolve()
    with replaced_atomically(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        _copy_model_files(model_path, tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def write_adapter_folder(tensors: dict[str, torch.Tensor], spec: LoraSpec, model_path: Path, out: Path,
                         dtype: torch.dtype, meta: dict[str, Any]) -> Path:
    """The adapters as a peft adapter folder (``adapter_config.json`` naming ``model_path`` as the base, the
    tensors in ``dtype``) next to copies of the base's tokenizer files; written to a temporary folder and
    renamed, so ``out`` is never half-written."""
    modules = pair_adapters(tensors.items())  # every matrix has its pair
    config = spec.peft_config(str(model_path), target_names(modules))
    out = out.resolve()
    with replaced_atomically(out) as tmp:
        write_adapter(tmp, {n: t.to(dtype) for n, t in tensors.items()}, config)
        _copy_model_files(model_path, tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _copy_model_files(model_path: Path, out: Path) -> None:
    """The tokenizer and generation files of the source model (not its weights, config or our markers)."""
    for item in model_path.iterdir():
        if item.is_file() and item.name != "config.json" and not item.name.endswith(_SKIP_SUFFIXES) \
                and not item.name.startswith("hybridrl_"):
            shutil.copy2(item, out / item.name)
