"""``train.py``'s answers before torch is imported: ``--help``, and the bad settings that need neither torch."""

from __future__ import annotations

import difflib
import re
import string
import sys
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import Container, DictConfig, OmegaConf, open_dict

from dpddp.cluster import refuse_non_integer_variables, register_resolvers
from dpddp.errors import ConfigError, fail
from dpddp.parallel.settings import LIGHTNING_STRATEGIES
from dpddp.run.plain import GROUPS as SECTIONS
from dpddp.run.plain import PRESETS, check_plain, check_resolvable, key_advice


def answer(argv: list[str]) -> None:
    """Print Hydra's help (exit 0), or ``fail`` with a bad setting judged without torch (exit 2); else return."""
    register_resolvers()
    if argv in (["--help"], ["-h"]):
        print(app_help())
        sys.exit(0)
    if len(argv) == 1 and argv[0] in ("--help", "-h", "--hydra-help"):  # Hydra's help, given alone
        hydra.main(version_base="1.3", config_path="pkg://dpddp.conf", config_name="config")(print)()  # exits
    refuse_non_integer_variables()
    if not argv or any(arg.startswith("-") for arg in argv):
        return
    try:
        overrides = OverridesParser.create().parse_overrides(argv)
    except Exception:  # Hydra's grammar refuses it: main's line (command_line.unreadable_override)
        return
    if any(o.is_sweep_override() for o in overrides):
        return
    if problem := unknown_option(argv):
        fail(problem)
    cfg = _composed(argv)
    if cfg is None:
        if line := _missing_top_level_key(argv, overrides):
            fail(line)
        return
    try:
        check_resolvable(cfg)
        check_plain(cfg)
    except ConfigError as err:
        fail(str(err))


def app_help() -> str:
    """Hydra's ``--help`` text for the packaged config, read from ``conf/`` (faster than Hydra's listing)."""
    with initialize_config_module(config_module="dpddp.conf", version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    template = str(cfg.hydra.help.template)
    conf = Path(str(files("dpddp.conf")))
    groups = {
        d.relative_to(conf).as_posix(): sorted(p.stem for p in d.glob("*.yaml"))
        for d in conf.rglob("*")
        if d.is_dir() and d.relative_to(conf).parts[0] != "hydra" and any(d.glob("*.yaml"))
    }
    with open_dict(cfg):
        del cfg["hydra"]
    listed = "".join(f"{group}: {', '.join(options)}\n" for group, options in sorted(groups.items()))
    return string.Template(template).substitute(APP_CONFIG_GROUPS=listed, CONFIG=OmegaConf.to_yaml(cfg))


def _composed(argv: list[str]) -> DictConfig | None:
    """The packaged config composed with ``argv``, without ``hydra``; ``None`` where Hydra refuses an override."""
    try:
        with initialize_config_module(config_module="dpddp.conf", version_base="1.3"):
            return compose(config_name="config", overrides=argv)
    except Exception:
        return None


def _top_level(override: Override) -> bool:
    """Whether ``override`` sets a key outside the config groups and ``hydra`` (``devises=2``)."""
    head = override.key_or_group.partition(".")[0]
    plain = override.package is None and not override.is_add() and not override.is_delete()
    return plain and head not in GROUPS and head != "hydra" and not override.is_force_add()


def _missing_top_level_key(argv: list[str], overrides: list[Override]) -> str | None:
    """The line for the first override of a top-level key the config lacks, when the others compose; else ``None``."""
    others = [arg for arg, o in zip(argv, overrides, strict=True) if not _top_level(o)]
    cfg = _composed(others)
    if cfg is None:
        return None
    keys, known = [str(k) for k in cfg.keys()], dotted_keys(cfg)
    for arg, override in zip(argv, overrides, strict=True):
        if _top_level(override):
            key = override.key_or_group
            if key in known:
                continue
            if key.partition(".")[0] in keys:
                return None  # a section's key: the full check says it (with the section's keys)
            return missing_key_line(override.input_line or arg, key, cfg, key_advice("", key, keys))
    return None


def missing_key_line(line: str, key: str, cfg: DictConfig, instead: str | None) -> str:
    """The line for the override ``line`` of ``key``, which ``cfg`` lacks: ``key_hints``, ``instead`` or ``+key``."""
    head, dot, rest = key.partition(".")
    if instead is not None and dot and (near := re.fullmatch(r"did you mean (\w+)\?", instead)):
        if f"{near.group(1)}.{rest}" in dotted_keys(cfg):  # mdoel.lr: model.lr, not model
            instead = f"did you mean {near.group(1)}.{rest}?"
    if instead is not None:
        return f"{line}: the config has no key {key}{key_hints(key, cfg, instead)}: {instead}"
    return f"{line}: the config has no key {key}{key_hints(key, cfg)}: give a key it has, or add a new one with +{line}"


GROUPS = ("strategy", *SECTIONS, *PRESETS)


def unknown_option(argv: list[str], lightning_line: Callable[[str], str | None] | None = None) -> str | None:
    """The line for the first ``group=option`` override with no such option (a Lightning one: ``lightning_line``)."""
    dirs = [Path(str(files("dpddp.conf")))]
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
        elif "hydra.searchpath" in arg:
            return None
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        hydra_group = key.startswith("hydra/")  # Hydra's own group: its options, its plugins' included
        if not sep or not (key in GROUPS or hydra_group) or "(" in value:
            continue
        for option in value.removeprefix("[").removesuffix("]").split(","):  # a list: callbacks=[a,b]
            if option not in ("", "null") and not any((d / key / f"{option}.yaml").is_file() for d in dirs):
                if key == "strategy" and option in LIGHTNING_STRATEGIES:  # Lightning's name: its line, or the check's
                    return lightning_line(option) if lightning_line else None
                if hydra_group:  # Hydra's options for it, its plugins' included
                    with initialize_config_module(config_module="dpddp.conf", version_base="1.3"):
                        known = GlobalHydra.instance().config_loader().get_group_options(key)
                    if option in known or not known:
                        continue
                    return f"{key}={option} is unknown: choose one of {', '.join(known)}"  # Hydra's line (-m)
                known = sorted({p.stem for d in dirs for p in (d / key).glob("*.yaml")})
                near = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]}?)" if near else ""
                return f"{key}={option} is unknown{hint}: choose one of {', '.join(known)}"
    return None


def dotted_keys(cfg: Container | dict, prefix: str = "") -> list[str]:
    """Every key of ``cfg`` at any depth, dotted, unresolved (a list's items not named)."""
    found: list[str] = []
    node: Any = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    for key, value in node.items():
        found.append(f"{prefix}{key}")
        if isinstance(value, dict):
            found += dotted_keys(value, f"{prefix}{key}.")
    return found


def key_hints(key: str, cfg: DictConfig, instead: str = "") -> str:
    """`` (<nearest key>; <the group's options that have it>)`` of ``key``, which ``cfg`` lacks, or ``""``."""
    keys = [k for k in dotted_keys(cfg) if key.startswith("hydra.") or not k.startswith("hydra")]
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
    said = [f"nearest: {near[0]}"] if near and near[0] not in instead else []
    group, _, rest = key.partition(".")
    if group in GROUPS and rest and group in cfg:
        having = []
        for path in sorted(Path(str(files("dpddp.conf"))).joinpath(group).glob("*.yaml")):
            text = path.read_text()
            global_package = any(line.split() == ["#", "@package", "_global_"] for line in text.splitlines()[:3])
            if (key if global_package else rest) in dotted_keys(OmegaConf.create(text)):
                having.append(path.stem)
        if having:
            verb = "has" if len(having) == 1 else "have"
            said.append(f"the chosen {group} config has none; {group}={', '.join(having)} {verb} one")
    return f" ({'; '.join(said)})" if said else ""
