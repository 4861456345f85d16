"""What every contract class shares: the kit's models (built once per test session), the device and
options of the backend under test (class attributes, overridable from the command line), engine factories
that release what they built."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hybridrl.testing import backends
from hybridrl.testing.models import KitModels, KitModelSpec, build_absolute_position_model, build_kit_models

_BUILT: dict[tuple[str, KitModelSpec], KitModels] = {}


def kit_models_for(tmp_path_factory: pytest.TempPathFactory, spec: KitModelSpec) -> KitModels:
    root = tmp_path_factory.getbasetemp() / "hybridrl-kit"
    key = (str(root), spec)
    if key not in _BUILT:
        _BUILT[key] = build_kit_models(root, spec)
    return _BUILT[key]


def cli_device(config: pytest.Config) -> str | None:
    return config.getoption("hybridrl_device", default=None)


def cli_options(config: pytest.Config) -> dict[str, Any]:
    """``--hybridrl-option key=value`` pairs (values parsed as YAML: ``0.3`` is a float, ``true`` a bool)."""
    options: dict[str, Any] = {}
    for text in config.getoption("hybridrl_options", default=None) or []:
        key, _, value = text.partition("=")
        options[key.strip()] = yaml.safe_load(value)
    return options


def free_device_memory() -> None:
    """Collect engines the caller has dropped: a GPU engine holds device memory until it is collected (on
    CPU reference counting frees it, and a full collection costs seconds, so it is skipped)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


class EngineSlot:
    """At most one engine of the backend under test alive at a time: engines such as vLLM or SGLang keep
    process-wide state (dropping one engine can tear down what another still uses) and each takes its share
    of the GPU. The shared engine is rebuilt when a test needed a fresh one in between; results computed
    from the shared engine are cached with it."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.engine: Any = None
        self.is_shared = False
        self.results: dict[str, Any] = {}

    def shared(self) -> Any:
        if self.engine is None or not self.is_shared:
            self.drop()
            self.engine, self.is_shared = self.make(), True
        return self.engine

    def fresh(self, **make_args: Any) -> Any:
        """An engine of its own (``make_args``: e.g. ``path=`` another model), the shared one dropped first."""
        self.drop()
        self.engine, self.is_shared = self.make(**make_args), False
        return self.engine

    def cached(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per life of the shared engine."""
        if key not in self.results:
            self.results[key] = compute()
        return self.results[key]

    def drop(self) -> None:
        dropped = self.engine is not None
        self.engine = None
        self.results.clear()
        if dropped:
            free_device_memory()


class KitBase:
    """Class attributes a subclass may set, and the fixtures built from them."""

    #: the registered backend name under test (required when subclassing a contract).
    backend: str | None = None
    #: ``cpu`` / ``cuda``; None: ``--hybridrl-device``, else cpu when the backend runs there, else cuda.
    device: str | None = None
    #: ``EngineContext.dtype`` the engines are built with (the kit's tolerances assume float32).
    dtype: str = "float32"
    #: extra ``ctx.options`` for the engine (on top of the role's defaults; ``--hybridrl-option`` wins).
    engine_options: dict[str, Any] = {}
    #: largest |engine - transformers| allowed between per-token log-probs.
    logprob_atol: float = 1e-4
    #: architecture of the kit's models.
    model_spec: KitModelSpec = KitModelSpec()
    #: False: the engine serves no GPT-2 (the position-id checks, which need one, are skipped saying so).
    serves_gpt2: bool = True

    @pytest.fixture(scope="class", autouse=True)
    def _kit_threads(self) -> Iterator[None]:
        """One intra-op thread while the kit runs: its models are tiny, so more threads only add
        synchronisation, and on a busy machine oversubscribed threads make each forward ~50x slower."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)

    @pytest.fixture(scope="class")
    def backend_name(self) -> str:
        if not self.backend:
            pytest.fail(f"{type(self).__name__}: set the class attribute backend = '<registered name>'",
                        pytrace=False)
        return self.backend

    @pytest.fixture(scope="class")
    def kit_device(self) -> Any:
        """Where the engines run; each contract resolves it (and skips when the backend cannot run here)."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    def kit_models(self, tmp_path_factory: pytest.TempPathFactory, kit_device: Any) -> KitModels:
        # depends on kit_device so that a backend that cannot run here is skipped before anything is built
        return kit_models_for(tmp_path_factory, self.model_spec)

    @pytest.fixture(scope="class")
    def position_model(self, tmp_path_factory: pytest.TempPathFactory, kit_device: Any) -> Path:
        """A tiny GPT-2 (learned absolute positions): where wrong position ids under left padding show."""
        if not self.serves_gpt2:
            pytest.skip(f"{type(self).__name__}.serves_gpt2 is False: the position-id check needs a GPT-2 model")
        return build_absolute_position_model(tmp_path_factory.getbasetemp() / "hybridrl-kit")

    def _options(self, config: pytest.Config, role: str, **overrides: Any) -> dict[str, Any]:
        # role defaults < the class's engine_options < --hybridrl-option < what the test itself needs (lr=0 ...)
        return backends.role_options(role, **{**self.engine_options, **cli_options(config), **overrides})


def engine_factory(kind: str, name: str, model_path: Path, device: str, dtype: str,
                   options: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """``make(role=None, path=None, lora=None, **option_overrides)`` builds a fresh engine of the backend
    (``lora``: a ``hybridrl.lora.LoraSpec``, the adapters of a LoRA run)."""

    def make(role: str | None = None, path: Path | None = None, lora: Any = None, **overrides: Any) -> Any:
        role = role or ("actor" if kind == "train" else "rollout")
        return backends.build_engine(kind, name, str(path or model_path), device, dtype, role=role,  # type: ignore[arg-type]
                                     options=options(role, **overrides), lora=lora)

    return make
