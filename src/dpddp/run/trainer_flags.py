"""Lightning's own check of the ``trainer`` flags, before anything is made: the flags go to a bare ``pl.Trainer``
(no logger, callbacks or strategy, one CPU device), so a value only Lightning knows to be wrong
(``trainer.precision=17``) is refused by Lightning's rule, in one line naming the flag, before Hydra makes the run
directory."""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from dpddp.run.keys import TRAINER_OWNED

__all__ = ["TRAINER_ERRORS", "refused_flag"]

TRAINER_ERRORS = (ValueError, TypeError, ImportError, MisconfigurationException)
"""What ``pl.Trainer`` raises for a flag it refuses (``ImportError``: a precision whose package is missing)."""
_BARE = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "accelerator": "cpu"}
_OWNED = (*TRAINER_OWNED, "plugins")  # what dpddp sets itself


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's lines at a Trainer's construction (GPU available, precision chosen) and its warnings, muted:
    the run's real Trainer says them."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def refused_flag(trainer: Mapping[str, Any]) -> str | None:
    """``trainer.<flag>=<value> is invalid: <Lightning's reason>`` for the first flag of the ``trainer`` section
    that ``pl.Trainer`` refuses alone (the flags are tried together first: one Trainer when all are valid), else
    ``None``. The top-level knobs and what dpddp sets itself (``strategy``, ``logger``, ...) are not tried."""
    flags = {str(k): v for k, v in trainer.items() if k not in _OWNED}
    defaults = inspect.signature(pl.Trainer.__init__).parameters
    with _quiet():
        try:
            pl.Trainer(**{**_BARE, **flags})
            return None
        except TRAINER_ERRORS as together:
            for key, value in flags.items():
                if key in defaults and value == defaults[key].default:
                    continue
                try:
                    pl.Trainer(**{**_BARE, key: value})
                except TRAINER_ERRORS as alone:
                    return f"trainer.{key}={value!r} is invalid: {_line(alone)}"
            return f"trainer: {_line(together)}"
