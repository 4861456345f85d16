"""One base for the errors users see (``hybridrl.errors.HybridRLError``), and the CLI telling them from bugs."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import hybridrl
from hybridrl import HybridRLError, cli
from hybridrl.config import ConfigError
from hybridrl.run.faults import Terminated

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["hybridrl", "hybridrl_fsdp", "hybridrl_megatron", "hybridrl_vllm", "hybridrl_sglang"]

#: exceptions that never reach the user as they are: each is caught and turned into something else.
INTERNAL = {
    "hybridrl.config.loading.DuplicateKeyError": "load_config turns it into a ConfigError naming the key",
    "hybridrl.rewards.http._Retryable": "the HTTP reward client retries it, then reports a RewardFailure",
    "hybridrl.rewards.calling.RewardFailure": "one failed reward call: the runner counts it and scores 0",
    "hybridrl.tools.calculator.CalculatorError": "the calculator tool's answer to the model, not to the user",
    "hybridrl.run.faults.Terminated": "SIGTERM as an exception (a BaseException, like KeyboardInterrupt)",
    "hybridrl.run.guarded_call.ChildFailure": "a guarded call's failure: its caller reports it under the user's key",
    "hybridrl.runtime.deadline.WorkersNotAnswering": "the run's guard turns it into a WorkerHangError",
}


def _package_files() -> dict[str, Path]:
    """Module name -> file, for the core and every plugin package of this tree."""
    found = {}
    for folder in [ROOT / "core" / "hybridrl", *sorted((ROOT / "plugins").glob("*/hybridrl_*"))]:
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _exception_classes() -> tuple[dict[str, type], dict[str, list[str]]]:
    """The exception classes each module defines (imported), and for modules that need an optional package
    this machine lacks, the bases of their classes as written (read, not imported)."""
    imported: dict[str, type] = {}
    unread: dict[str, list[str]] = {}
    for name, path in _package_files().items():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] in PACKAGES:
                raise
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    unread[f"{name}.{node.name}"] = [ast.unparse(base) for base in node.bases]
            continue
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                imported[f"{name}.{attr}"] = obj
    return imported, unread


def test_every_user_facing_exception_derives_from_hybridrl_error() -> None:
    imported, unread = _exception_classes()
    assert "hybridrl.config.schema.ConfigError" in imported and "hybridrl_megatron.convert.ConversionError" in imported
    outside = sorted(name for name, cls in imported.items()
                     if not issubclass(cls, HybridRLError) and name not in INTERNAL)
    assert not outside, f"derive these from hybridrl.errors.HybridRLError (or list them in INTERNAL): {outside}"
    assert set(INTERNAL) <= set(imported), "INTERNAL names a class that no longer exists"
    assert not any(issubclass(imported[name], HybridRLError) for name in INTERNAL)
    ours = {cls.__name__ for cls in imported.values() if issubclass(cls, HybridRLError)}
    unchecked = {name: bases for name, bases in unread.items()
                 if any(b.endswith(("Error", "Exception")) for b in bases) and not set(bases) & ours}
    assert not unchecked, unchecked


def test_the_other_bases_are_kept() -> None:
    from hybridrl.data.loading import DataError
    from hybridrl.run.faults import WorkerDiedError

    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(WorkerDiedError, RuntimeError)
    assert hybridrl.HybridRLError is HybridRLError


def _run_cli(monkeypatch, capsys, raised: BaseException) -> tuple[int, str]:
    def fail(args) -> int:
        raise raised

    monkeypatch.setattr(cli, "cmd_plugins", fail)
    status = cli.main(["plugins"])
    return status, capsys.readouterr().err


def test_an_unexpected_exception_is_reported_as_a_bug_with_its_traceback(monkeypatch, capsys) -> None:
    status, err = _run_cli(monkeypatch, capsys, KeyError("rollout"))
    assert status == 1
    assert err.startswith(cli.BUG_LINE) and "bug in hybridrl or in a plugin" in err
    assert "Traceback (most recent call last)" in err and "KeyError: 'rollout'" in err


def test_a_hybridrl_error_is_its_sentence_without_traceback(monkeypatch, capsys) -> None:
    status, err = _run_cli(monkeypatch, capsys, ConfigError([("roles.actor.lr", "must be > 0")]))
    assert status == 2  # a refused input, as before
    assert err == "hybridrl: invalid config (1 problem):\n  roles.actor.lr: must be > 0\n"

    class PluginProblem(HybridRLError):
        pass

    status, err = _run_cli(monkeypatch, capsys, PluginProblem("the engine needs CUDA 12; this machine has 11.8."))
    assert status == 1
    assert err == "hybridrl: the engine needs CUDA 12; this machine has 11.8.\n"
    assert "bug" not in err and "Traceback" not in err


@pytest.mark.parametrize("raised, status, said", [(KeyboardInterrupt(), 130, "interrupted"),
                                                  (Terminated(), 143, "terminated (SIGTERM)")])
def test_signals_keep_their_status(monkeypatch, capsys, raised, status, said) -> None:
    got, err = _run_cli(monkeypatch, capsys, raised)
    assert got == status and err == f"hybridrl: {said}\n"
