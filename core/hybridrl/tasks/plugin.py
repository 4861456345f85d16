"""The core's bundled tasks: the ``reverse`` and ``copy_ragged`` rewards and datasets, the ``arithmetic`` dataset, the
``reasoning_gym`` dataset and reward, and the ``calc`` tool task (dataset, environment, ``arith`` call parser)
(registered directly by the host, ``plugins.discovery.CORE_PLUGINS``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry


@hookimpl
def hybridrl_register_rewards(registry: Registry) -> None:
    registry.add_reward("reverse", "hybridrl.tasks.reverse:reverse_reward")
    registry.add_reward("copy_ragged", "hybridrl.tasks.copy_ragged:copy_ragged_reward")
    registry.add_reward("reasoning_gym", "hybridrl.tasks.reasoning_gym:reasoning_gym_reward")


@hookimpl
def hybridrl_register_datasets(registry: Registry) -> None:
    registry.add_dataset("reverse", "hybridrl.tasks.reverse:make_reverse_rows")
    registry.add_dataset("copy_ragged", "hybridrl.tasks.copy_ragged:make_copy_ragged_rows")
    registry.add_dataset("arithmetic", "hybridrl.tasks.arithmetic:make_arithmetic_rows")
    registry.add_dataset("reasoning_gym", "hybridrl.tasks.reasoning_gym:make_reasoning_gym_rows")
    registry.add_dataset("calc", "hybridrl.tasks.calc:make_calc_rows")


@hookimpl
def hybridrl_register_environments(registry: Registry) -> None:
    registry.add_environment("calc", "hybridrl.tasks.calc:CalcEnvironment")
    registry.add_tool_parser("arith", "hybridrl.tasks.calc:arith")
