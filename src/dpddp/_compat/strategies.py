"""Lightning's strategy registry read as data, and the text of the DDP error for an unused parameter: checked in
Lightning ``CHECKED``; tests/test_compat.py fails when one moves."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

__all__ = ["CHECKED", "UNUSED_PARAMETERS", "registered_strategies"]

CHECKED = "2.6.6"
"""The Lightning version every entry below was read in and tested against."""

UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"
"""How torch's ``DistributedDataParallel`` error for a parameter that took no part in the last step's loss begins
(the pattern Lightning's ``DDPStrategy.on_exception`` matches, Lightning 2.6.6). If it changes: the error keeps
torch's own text, cut at the line's length."""


def registered_strategies() -> dict[str, tuple[type, dict[str, Any]]]:
    """Every name in Lightning's ``StrategyRegistry``: its strategy class and the arguments the name gives it
    (``ddp_find_unused_parameters_true``: ``DDPStrategy``, ``find_unused_parameters=True,
    start_method='popen'``). The registry's entries are ``{"strategy": cls, "init_params": {...}}`` in Lightning
    2.6.6 (``_StrategyRegistry.register``). If they move: a ``KeyError`` here, named by test_compat."""
    return {
        name: (StrategyRegistry[name]["strategy"], dict(StrategyRegistry[name]["init_params"]))
        for name in StrategyRegistry.available_strategies()
    }
