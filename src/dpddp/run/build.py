"""Building a config node: a class that refuses its arguments is one ``ConfigError`` line naming the key."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dpddp._compat import locate
from dpddp.errors import ConfigError
from dpddp.messages import instantiate_key, instantiate_target, locating_failed, named_setting, unexpected_keyword
from dpddp.report.trackers import is_tracker
from dpddp.run.keys import import_problem


def build(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """``instantiate(node, **kwargs)`` of the node at ``key``; ``ConfigError`` (``build_error``) where it fails."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        raise build_error(node, key, err) from err


def build_error(node: DictConfig, key: str, err: InstantiationException) -> ConfigError:
    """The ``ConfigError`` for Hydra's ``err`` building ``node`` at ``key``: the failing key, target and cause."""
    text = str(err)
    full_key = instantiate_key(text) or key
    inner = node if full_key == key else OmegaConf.select(node, full_key.removeprefix(f"{key}."), default=None)
    spec = OmegaConf.to_container(inner, resolve=False) if isinstance(inner, DictConfig) else {}
    assert isinstance(spec, dict)
    target = str(spec.get("_target_") or instantiate_target(text) or "?")  # as given
    if locating_failed(text):
        problem = import_problem(target) or "it cannot be imported"
        return ConfigError(f"{full_key}._target_={target!r} cannot be imported ({problem}): check the name")
    cause = err.__cause__ or err
    if isinstance(cause, ConfigError):  # the class's own line
        return cause
    reason = (str(cause).splitlines() or [""])[0]
    given = unexpected_keyword(reason)
    if given is not None and isinstance(cause, TypeError):
        try:
            params = [p for p in inspect.signature(locate(target)).parameters if p not in ("self", "args", "kwargs")]
        except (ImportError, ValueError, TypeError):
            params = []
        near = difflib.get_close_matches(given, params, n=1, cutoff=0.6)
        hint = f"did you mean {full_key}.{near[0]}?" if near else f"its arguments: {', '.join(params)}"
        return ConfigError(
            f"{full_key}.{given}={spec.get(given)!r}: {target} takes no {given} ({hint}): drop it with "
            f"~{full_key}.{given}, or give an argument it takes"
        )
    setting = named_setting(reason, [str(k) for k in spec if k != "_target_"])
    why = f"{type(cause).__name__}: {reason}" if reason else type(cause).__name__
    if setting is not None:
        return ConfigError(
            f"{full_key}.{setting}={spec[setting]!r} is refused by {target} ({why}): give a value it takes"
        )
    if kind := is_tracker(spec):  # its arguments taken: the store or service failed
        name, where = ("MLflow", f"{full_key}.tracking_uri") if kind == "mlflow" else ("W&B", "WANDB_MODE, wandb login")
        return ConfigError(f"{full_key} ({target}): {name} itself failed ({why}), not its arguments: check {where}")
    return ConfigError(f"{full_key} ({target}) cannot be built ({why}): give it arguments its class takes")
