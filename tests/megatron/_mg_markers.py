"""The marker of tests that need megatron-core: marked ``megatron`` and skipped, with the reason, without it."""

from __future__ import annotations

import importlib.util

import pytest


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no "megatron" package at all
        return False


#: ``pytestmark = needs_megatron`` in a test module that builds engines.
needs_megatron = [
    pytest.mark.megatron,
    pytest.mark.skipif(not _megatron_installed(),
                       reason="megatron-core is not installed (pip install 'hybridrl-megatron[engine]')"),
]
