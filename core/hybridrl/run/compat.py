"""What a checkpoint depends on besides its roles' backends: the shape of each trained role's model and the
number of prompt rows its data position counts. Recorded in ``driver.json`` at every save and compared in
pre-flight before a resume, so that a run which could not load its checkpoint is refused by name before
anything is written (a changed ``model.tiny.hidden_size`` used to overwrite the run's files first and then
fail on a size mismatch after the workers had started).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.model.signature import model_signature  # noqa: F401  (re-exported: its home before)


def _hf_config(cfg: RunConfig, path: str | None) -> Any:
    """The HF config of the policy (``path`` None) or of another checkpoint folder."""
    from transformers import AutoConfig

    if path is None and cfg.model.tiny is not None:
        from hybridrl.model.tiny import tiny_hf_config

        return tiny_hf_config(cfg.model.tiny)
    return AutoConfig.from_pretrained(path or cfg.model.path)


def role_signatures(cfg: RunConfig, trained: list[str]) -> dict[str, dict[str, Any]]:
    """The model signature of each trained role (the critic's backbone is its ``model_path`` or the policy's)."""
    out = {}
    for role in trained:
        path = cfg.roles.critic.model_path if role == "critic" and cfg.roles.critic is not None else None
        out[role] = model_signature(_hf_config(cfg, path))
    return out


def saved_signatures(summary: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The signatures a checkpoint recorded; for one saved before they were, the policy's rebuilt from the
    model folder it names (still intact: pre-flight writes nothing), else None (nothing to compare)."""
    if "model_signatures" in summary:
        return summary["model_signatures"]
    config_file = Path(summary.get("model_path", "")) / "config.json"
    if not config_file.is_file():
        return None
    from transformers import AutoConfig

    try:
        signature = model_signature(AutoConfig.from_pretrained(config_file.parent))
    except (OSError, ValueError, KeyError):
        return None
    return {role: signature for role in summary.get("roles", {}) if role != "critic"}


def shape_problems(folder: Path, saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]]) -> list[str]:
    """One line per trained role whose model differs in shape from the checkpoint's, naming the config
    entries (or, failing that, the tensors) that differ."""
    problems = []
    for role, now in current.items():
        then = saved.get(role)
        if then is None or then["shapes"] == now["shapes"]:
            continue
        keys = sorted(k for k in set(then["config"]) | set(now["config"])
                      if then["config"].get(k) != now["config"].get(k))
        if keys:
            diff = ", ".join(f"{k} {then['config'].get(k)} there, {now['config'].get(k)} here" for k in keys[:6])
        else:
            names = [n for n in sorted(set(then["shapes"]) | set(now["shapes"]))
                     if then["shapes"].get(n) != now["shapes"].get(n)]
            diff = ", ".join(f"{n} {then['shapes'].get(n)} there, {now['shapes'].get(n)} here" for n in names[:3])
        problems.append(f"checkpoint '{folder}' holds a {role} of another shape than this run's model ({diff}); "
                        "resume it with the model it was saved from, or start a new run (another trainer.out, or "
                        "trainer.resume=never with --overwrite, which moves this run aside)")
    return problems


def data_rows_problem(folder: Path, summary: dict[str, Any], rows: int) -> str | None:
    """The data position of a checkpoint counts rows of its data: another number of prompts cannot resume it."""
    saved = summary.get("data_rows")
    if saved is None:
        from hybridrl.run.checkpoint import load_driver_state

        try:
            saved = load_driver_state(folder).get("loader", {}).get("num_rows")
        except Exception:  # noqa: BLE001 - an unreadable state is reported by the checkpoint's own check
            return None
    if saved is None or int(saved) == rows:
        return None
    return (f"checkpoint '{folder}' was saved with {saved} prompts and the data now has {rows} (its data position "
            "counts rows of the data it was saved with); resume with that data, or start a new run")


def read_summary(folder: Path) -> dict[str, Any]:
    from hybridrl.run.checkpoint import DRIVER_SUMMARY

    return json.loads((folder / DRIVER_SUMMARY).read_text())
