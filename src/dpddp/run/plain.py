"""The config's groups, and its interpolations checked (no torch or Lightning)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dpddp.errors import ConfigError
from dpddp.messages import omegaconf_reason

GROUPS = ("data", "model", "trainer", "logger", "callbacks")  # the config's sections that are groups
PRESETS = ("experiment", "debug", "hparams_search")  # the groups of presets, merged at the top level


def _interpolations(node: Any, path: tuple = ()) -> Iterable[tuple[tuple, str]]:
    """``(path, value)`` of every string holding an interpolation in the unresolved container ``node``."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, str) and "${" in value:
            yield (*path, key), value
        else:
            yield from _interpolations(value, (*path, key))


def check_resolvable(cfg: DictConfig) -> None:
    """``ConfigError`` for the first interpolation of ``cfg`` (outside ``hydra``) that does not resolve."""
    for path, value in _interpolations(OmegaConf.to_container(cfg, resolve=False)):
        if path[0] == "hydra":
            continue
        dotted = "".join(f"[{p}]" if isinstance(p, int) else f"{'.' if i else ''}{p}" for i, p in enumerate(path))
        try:
            node: Any = cfg
            for key in path:  # not OmegaConf.select: its dotted grammar reads a key "a.b" as two keys
                node = node[key]
        except Exception as err:  # OmegaConf's resolution errors, or a resolver's own
            reason = omegaconf_reason((str(err).splitlines() or [type(err).__name__])[0])
            env = re.search(r"\$\{oc\.env:([^,}]+)", value)
            fix = (
                f"set {env.group(1)} in the environment, or give a default: ${{oc.env:{env.group(1)},<default>}}"
                if env
                else "give a value, or interpolate a key that exists (e.g. ${data.num_features})"
            )
            if path[0] == "model" and value == f"${{data.{path[-1]}}}":  # the model's sizes follow the data's
                fix = (
                    f"the data has no {path[-1]} to follow: give the model's sizes (model.num_features=<features per "
                    "sample> model.num_classes=<classes>), or, for a class that takes neither, give model a yaml of "
                    "its own (conf/model/<name>.yaml)"
                )
            raise ConfigError(f"{dotted}={value!r} cannot be resolved ({reason}): {fix}") from err
