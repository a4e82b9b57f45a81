"""``compile=true|<mode>``: the model's ``forward`` compiled by ``torch.compile``, under one process and ddp; the
module, its ``state_dict`` keys and its checkpoints stay those of eager. See docs/performance.md (compile).

The forward alone, not the module's ``__call__`` (``nn.Module.compile``) nor the steps (Lightning's
``trainer.fit(torch.compile(model))``): Lightning's DDP calls the module with its ``forward`` redirected to the
step, and a compiled step retraces at every step of a model that keeps per-step Python state (the built-in
models' loss list), until torch's recompile limit turns compiling off."""

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
"""``torch.compile``'s modes (torch 2.13; tests/test_compat.py checks that torch takes each)."""

COMPILE_LIMITS = (
    (
        "strategy",
        ("auto", *DDP_FAMILY),
        "DataParallel's replicas run the model's forward uncompiled; ddp compiles it on every rank",
    ),
)
"""Settings that cannot keep the promises with ``compile``: (setting, the values that can, why), as
``dpddp.run.config.EXECUTION_LIMITS``."""


def compile_mode(cfg: Mapping) -> str | None:
    """The ``torch.compile`` mode of ``cfg["compile"]``: ``None`` for ``false`` (eager), ``"default"`` for
    ``true``, or the mode named.

    Raises:
        ConfigError: another value (``compile=fast``), in one line naming the values taken.
    """
    value = cfg.get("compile", False)
    if value is False:
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in MODES:
        return value
    raise ConfigError(
        f"compile={value!r} is not offered: use compile=true (torch.compile's default mode), a mode "
        f"({', '.join(MODES)}) or compile=false"
    )


def compile_model(model: nn.Module, mode: str | None) -> None:
    """Give ``model`` its class's ``forward`` compiled by ``torch.compile`` in ``mode`` (``None``: nothing), traced
    at its first call, as an instance attribute (a bound method: a ``copy.deepcopy`` of the model binds its own
    copy); the compiled graphs of an earlier model in this process (a sweep's earlier job) are dropped first, so
    that they do not count towards torch's recompile limit."""
    if mode is None:
        return
    torch.compiler.reset()
    forward = torch.compile(type(model).forward, mode=mode)
    model.forward = types.MethodType(forward, model)
    if writes_outputs():  # once per run
        log.info(f"compile={mode}: {type(model).__name__}'s forward is compiled by torch.compile at its first call")
