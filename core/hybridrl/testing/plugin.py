"""The pytest plugin (``pytest11`` entry point ``hybridrl.testing.plugin``): ``pytest --hybridrl-backend=NAME``.

With the option, the battery module (``hybridrl/testing/battery.py``) is collected for the named
backends; without explicit test paths it is the only thing collected, with paths it runs next to them.
Kinds nobody selected are left out (a rollout alone gets the rollout and bridge batteries).
Loaded by every pytest run where hybridrl is installed, so it imports nothing heavy
(``-p no:hybridrl.testing.plugin`` turns it off; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` load it with
``-p hybridrl.testing.plugin``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hybridrl.testing.selection import Selection, SelectionError, select

SELECTION = pytest.StashKey[Selection]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hybridrl", "hybridrl backend conformance kit")
    group.addoption("--hybridrl-backend", action="append", default=[], dest="hybridrl_backend", metavar="NAME",
                    help="run the hybridrl conformance battery for this registered backend (repeatable; its "
                         "kind, train or rollout, comes from the registry)")
    group.addoption("--hybridrl-device", default="auto", choices=("auto", "cpu", "cuda"), dest="hybridrl_device",
                    help="device the kit builds engines on (auto: cpu when the backend runs there, else cuda)")
    group.addoption("--hybridrl-option", action="append", default=[], dest="hybridrl_options",
                    metavar="KEY=VALUE", help="extra engine option (ctx.options, value parsed as YAML) for every "
                                              "engine the kit builds, e.g. gpu_memory_utilization=0.3")


def battery_path() -> Path:
    spec = importlib.util.find_spec("hybridrl.testing.battery")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin)


def pytest_configure(config: pytest.Config) -> None:
    # the kit's CUDA-only checks carry this marker (``-m "not gpu"`` leaves them out) in any project
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped elsewhere)")
    names = config.getoption("hybridrl_backend") or []
    for text in config.getoption("hybridrl_options") or []:
        if "=" not in text:
            raise pytest.UsageError(f"--hybridrl-option expects KEY=VALUE, got '{text}'")
    if not names:
        return
    from hybridrl.plugins.discovery import get_registry

    try:
        selection = select(names, set(get_registry().backends))
    except SelectionError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[SELECTION] = selection
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = []  # no paths named: the battery alone (added at collection)


def selection_of(config: pytest.Config) -> Selection:
    return config.stash.get(SELECTION, Selection())


def pytest_report_header(config: pytest.Config) -> list[str]:
    selection = config.stash.get(SELECTION, None)
    if selection is None:
        return []
    bridges = ", ".join(f"{t}->{r}" for t, r in selection.bridges) or "none"
    return [f"hybridrl kit: train {', '.join(selection.train) or 'none'}; rollout "
            f"{', '.join(selection.rollout) or 'none'}; bridges {bridges}"]


#: how the battery's tests are named: ``hybridrl/testing/battery.py::TestRolloutEngine::test_...[name]``
BATTERY_NODEID = "hybridrl/testing/battery.py"


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection and --lf, which then apply to the battery too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add the battery's tests for the selected backends (kinds nobody selected are left out)."""
    if SELECTION not in config.stash:
        return
    module = pytest.Module.from_parent(session, path=battery_path(), nodeid=BATTERY_NODEID)
    battery = list(session.genitems(module))
    unselected = [item for item in battery if not _parametrized(item)]
    if unselected:
        config.hook.pytest_deselected(items=unselected)
    items.extend(item for item in battery if _parametrized(item))


def _parametrized(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "backend_name" in params or "bridge_pair" in params
