"""``compile=true|<mode>``: the model's ``forward`` compiled by ``torch.compile``; the module and its checkpoints
stay eager's. See docs/performance.md (compile) and docs/design-notes.md (run.compiling)."""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping

import torch
from torch import nn

from dpddp.cluster import writes_outputs
from dpddp.errors import ConfigError
from dpddp.parallel.rules import DDP_FAMILY

__all__ = ["COMPILE_LIMITS", "MODES", "compile_mode", "compile_model"]

log = logging.getLogger(__name__)

MODES = ("default", "lite", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile``'s modes (tests/test_compat.py checks that torch takes each)."""

COMPILE_LIMITS = (
    (
        "strategy",
        ("auto", *DDP_FAMILY),
        "DataParallel's replicas run the model's forward uncompiled; ddp compiles it on every rank",
    ),
)
"""(setting, the values that keep the promises with ``compile``, why), as ``run.config.EXECUTION_LIMITS``."""


def compile_mode(cfg: Mapping) -> str | None:
    """The ``torch.compile`` mode of ``cfg["compile"]``: ``None`` (eager), ``"default"`` for ``true``, or the one
    named. Raises ``ConfigError`` for another value."""
    value = cfg.get("compile", False)
    if isinstance(value, bool) or (isinstance(value, str) and value in MODES):
        return "default" if value is True else value or None
    raise ConfigError(
        f"compile={value!r} is not offered: use compile=true (torch.compile's default mode), a mode "
        f"({', '.join(MODES)}) or compile=false"
    )


def compile_model(model: nn.Module, mode: str | None) -> None:
    """Give ``model`` its class's ``forward`` compiled in ``mode`` (``None``: nothing) as a bound instance
    attribute, after dropping an earlier job's graphs (they count towards torch's recompile limit)."""
    if mode is None:
        return
    torch.compiler.reset()
    forward = torch.compile(type(model).forward, mode=mode)
    model.forward = types.MethodType(forward, model)
    if writes_outputs():  # once per run
        log.info(f"compile={mode}: {type(model).__name__}'s forward is compiled by torch.compile at its first call")
