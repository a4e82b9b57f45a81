"""Lightning's strategy registry and ``DDPStrategy._ddp_kwargs``, checked in Lightning ``CHECKED``;
tests/test_compat.py fails when one moves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

CHECKED = "2.6.6"
"""The Lightning version every entry below was read in and tested against."""


def registered_strategies() -> dict[str, tuple[type, dict[str, Any]]]:
    """``{name: (strategy class, the arguments the name gives it)}`` of Lightning's ``StrategyRegistry``."""
    return {
        name: (StrategyRegistry[name]["strategy"], dict(StrategyRegistry[name]["init_params"]))
        for name in StrategyRegistry.available_strategies()
    }


@contextmanager
def wrapping_frozen(strategy: DDPStrategy, module: torch.nn.Module) -> Iterator[None]:
    """Inside it, ``strategy`` wraps ``module``'s frozen parameters in DDP too (through ``_ddp_kwargs``)."""
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
