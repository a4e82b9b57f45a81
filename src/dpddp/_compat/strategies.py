"""Lightning's strategy registry read as data, the text of the DDP error for an unused parameter, and the DDP
strategy's arguments for ``DistributedDataParallel`` (its private ``_ddp_kwargs``): checked in Lightning
``CHECKED``; tests/test_compat.py fails when one moves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

__all__ = ["CHECKED", "UNUSED_PARAMETERS", "registered_strategies", "wrapping_frozen"]

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


@contextmanager
def wrapping_frozen(strategy: DDPStrategy, module: torch.nn.Module) -> Iterator[None]:
    """Inside it, ``strategy`` wraps ``module`` in ``DistributedDataParallel`` over its frozen parameters too: they
    require gradients while it is built, then are frozen again, and it finds unused parameters each step (the
    frozen ones give no gradient until unfrozen). ``DistributedDataParallel`` all-reduces only the parameters
    that required gradients when it was built: one unfrozen later (``BaseFinetuning``) would train on each
    rank's own gradients. Sets ``find_unused_parameters`` in Lightning's ``DDPStrategy._ddp_kwargs`` (2.6.6)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    if frozen:
        strategy._ddp_kwargs["find_unused_parameters"] = True
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
