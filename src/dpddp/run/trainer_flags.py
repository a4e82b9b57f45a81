"""The ``trainer`` flags checked by Lightning itself (its signature's types, a bare ``pl.Trainer``) before a run."""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from jsonargparse import ArgumentError, ArgumentParser
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from dpddp.messages import jsonargparse_refusal
from dpddp.run.keys import TRAINER_OWNED

TRAINER_ERRORS = (ValueError, TypeError, ImportError, MisconfigurationException)  # ImportError: a missing package
_BARE = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "accelerator": "cpu"}


def _accepts(hint: Any) -> str:
    """A type hint in words: ``Optional[Union[bool, Literal['warn']]]`` is ``bool, 'warn' or null``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_accepts(arg) for arg in typing.get_args(hint)]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if typing.get_origin(hint) is typing.Literal:
        return ", ".join(repr(arg) for arg in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def takes(flag: str) -> str | None:
    """What ``pl.Trainer``'s signature takes for ``flag``, in words; ``None`` for a name it lacks."""
    hint = typing.get_type_hints(pl.Trainer.__init__).get(flag)
    return None if hint is None else _accepts(hint)


def _mistyped(flags: Mapping[str, Any]) -> str | None:
    """The first flag whose value ``pl.Trainer``'s signature does not take, in one line (a null is never checked)."""
    given = {k: v for k, v in flags.items() if v is not None and k != "sync_batchnorm"}  # dpddp's auto included
    parser = ArgumentParser(exit_on_error=False)  # what LightningCLI checks a flag's type with
    parser.add_class_arguments(pl.Trainer, "trainer")
    try:
        parser.parse_object({"trainer": given})
    except ArgumentError as err:
        named = jsonargparse_refusal([x.strip() for x in str(err).splitlines()]).key or ""
        key = named.removeprefix("trainer.")
        if not named.startswith("trainer.") or key not in given:
            return f"trainer: {_line(err)}"
        return f"trainer.{key}={given[key]!r} is invalid: pl.Trainer takes {takes(key)} for {key}"
    return None


def _line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def refused_flag(trainer: Mapping[str, Any]) -> str | None:
    """``trainer.<flag>=<value> is invalid: <why>`` for the first flag ``pl.Trainer`` refuses, or ``None``."""
    given = OmegaConf.to_container(trainer, resolve=True) if isinstance(trainer, DictConfig) else trainer
    assert isinstance(given, Mapping)
    flags = {str(k): v for k, v in given.items() if k not in TRAINER_OWNED and k != "plugins"}  # dpddp sets them
    if problem := _mistyped(flags):
        return problem
    defaults = inspect.signature(pl.Trainer.__init__).parameters
    with warnings.catch_warnings(), contextlib.ExitStack() as restore:  # the run's own Trainer says its lines
        warnings.simplefilter("ignore")
        for lg in (logging.getLogger("lightning.pytorch"), logging.getLogger("lightning.fabric")):
            restore.callback(lg.setLevel, lg.level)
            lg.setLevel(logging.ERROR)
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
