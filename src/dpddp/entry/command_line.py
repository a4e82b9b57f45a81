"""The command lines of ``train.py`` and ``dpddp``, and a sweep's syntax, refused in one line before anything runs."""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, ValueType
from hydra.errors import MissingConfigException, OverrideParseException, SearchPathException
from hydra.utils import get_class
from omegaconf import Container, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from dpddp._compat import hydra_argument_error, hydra_command_line
from dpddp.errors import ConfigError
from dpddp.messages import (
    argparse_choice,
    defaults_list_parent,
    hydra_override_reason,
    jsonargparse_refusal,
    missing_primary_config,
    unrecognized,
)
from dpddp.parallel.rules import DDP_OPTIONS, check_strategy_options, lightning_name_line
from dpddp.run.config import install_advice
from dpddp.run.keys import GROUPS as SECTIONS
from dpddp.run.keys import PRESETS, key_hint
from dpddp.run.trainer_flags import takes

GROUPS = ("strategy", *SECTIONS, *PRESETS)


def unknown_option(argv: list[str]) -> str | None:
    """The line for the first ``group=option`` override with no such option (a Lightning strategy: its line)."""
    args = hydra_command_line(argv)
    if any("hydra.searchpath" in arg for arg in argv) or args and not Path(args.config_dir or ".").is_dir():
        return None  # Hydra's search path: its failure, said first
    dirs = [Path(str(files("dpddp.conf"))), *([Path(args.config_dir)] if args and args.config_dir else [])]
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or "(" in value:  # Hydra's own groups (hydra/launcher): Hydra's failure
            continue
        for option in value.removeprefix("[").removesuffix("]").split(","):  # a list: callbacks=[a,b]
            unset = option == "" or option == "null" and arg.startswith("~")  # ~group=null: Hydra deletes it
            if not unset and not any((d / key / f"{option}.yaml").is_file() for d in dirs):
                if key == "strategy" and (line := lightning_name_line(option)):
                    return line
                return unknown_line(key, option, sorted({p.stem for d in dirs for p in (d / key).glob("*.yaml")}))
    return None


def unknown_line(group: str, option: str, known: Sequence[str], where: str = "") -> str:
    """The line for ``group=option``, not one of ``known``: the nearest option, then all of them."""
    near = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"{group}={option} is unknown{where}{hint}: choose one of {', '.join(known)}"


def dotted_keys(cfg: Container | dict, prefix: str = "") -> Iterator[str]:
    """Every key of ``cfg`` at any depth, dotted, unresolved (a list's items not named)."""
    node: Any = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    for key, value in node.items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from dotted_keys(value, f"{prefix}{key}.")


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


MODES: tuple[tuple[str, str], ...] = (("run", "--run (-r)"), ("multirun", "--multirun (-m)"), ("cfg", "--cfg (-c)"))
MODES += (("info", "--info (-i)"), ("shell_completion", "--shell-completion (-sc)"))
"""Hydra's command-line modes (a command takes one): the parsed flag, and its spellings."""
MODE_USES = {"run": "runs one job", "multirun": "runs a sweep", "cfg": "prints the composed config"}
MODE_USES |= {"info": "prints what Hydra composes it from", "shell_completion": "sets up shell completion"}
"""What each of ``MODES`` does, for the line that asks to keep one."""


def mode_conflict(argv: list[str]) -> str | None:
    """One line for Hydra modes of ``argv`` that cannot be combined, or ``--resolve`` without ``--cfg``."""
    args = hydra_command_line(argv)
    if args is None or args.help or args.hydra_help:
        return None
    given = [(name, spelled) for name, spelled in MODES if getattr(args, name) not in (None, False)]
    if len(given) > 1:
        names = [name for name, _ in given]
        if "multirun" in names and "cfg" in names:
            advice = "--cfg job prints a run's config: give one value per setting, not a sweep list"
        else:
            advice = "; ".join(f"{spelled.split()[0]} {MODE_USES[name]}" for name, spelled in given)
        both = " and ".join(spelled for _, spelled in given)
        return f"{both} cannot be given together: Hydra runs one of them; keep one ({advice})"
    if args.resolve and args.cfg is None:
        return "--resolve works only with --cfg: add --cfg job (or hydra, all), or drop --resolve"
    return None


MODE_GROUPS = ("hparams_search",)  # the packaged groups whose options may set hydra.mode (test_compat composes each)
CONFIG_OPTIONS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")  # the configs composed


def sets_no_mode(argv: list[str]) -> bool:
    """Whether ``argv``'s config surely sets no ``hydra.mode`` (Hydra's first composition is then skipped)."""
    for arg in argv:
        key = arg.partition("=")[0].lstrip("+~")
        if key in MODE_GROUPS or "hydra.mode" in arg or "hydra.searchpath" in arg or arg.startswith(CONFIG_OPTIONS):
            return False
    return True


def refused_arguments(argv: list[str], prog: str) -> str | None:
    """One line for a command line Hydra's own parser refuses, naming ``prog --help``; else ``None``."""
    message = hydra_argument_error(argv)
    if message is None:
        return None
    if (choice := argparse_choice(message)) is not None:
        option, value, known = choice
        example = f"{option} {known[0]} {value}" if "=" in value else f"{option} {known[0]}"  # an override taken
        return f"{option} {value} is not a choice of {option}: give one of {', '.join(known)} ({example})"
    return f"{message.removeprefix('argument ')}: see {prog} --help"


HYDRA_FAILURES = (MissingConfigException, SearchPathException)  # a search path, config or option not found


def hydra_failure(err: Exception, argv: list[str]) -> str:
    """One line for ``err`` (one of ``HYDRA_FAILURES``) raised for ``argv``, with the options there are."""
    args = hydra_command_line(argv)
    first = (str(err).splitlines() or [type(err).__name__])[0]
    hydra = GlobalHydra.instance()
    loader = hydra.config_loader() if hydra.is_initialized() else None
    missing = getattr(err, "missing_cfg_file", None)
    if isinstance(err, SearchPathException) or missing is None:
        option = "--config-dir" if isinstance(err, SearchPathException) else "--config-path"
        given = getattr(args, option[2:].replace("-", "_"), None) if args is not None else None
        return f"{option} {given} cannot be used ({first.rstrip('.')}): give a directory of configs, or drop {option}"
    name = (args.config_name if args is not None else None) or "config"
    if missing == name and missing_primary_config(first):
        known = [o for o in (loader.get_group_options("") if loader else []) if not o.startswith("_")]
        where = ", ".join(s.full_path() for s in loader.get_sources()) if loader else "the config search path"
        fix = f"choose one of {', '.join(known)}, or add your configs' directory with --config-dir <dir>"
        return f"--config-name {name}: no config {name}.yaml in {where}: {fix}"
    group, _, option = missing.rpartition("/")
    known = list(getattr(err, "options", None) or (loader.get_group_options(group) if loader else []))
    typed = any(a.partition("=")[0].lstrip("+~").partition("@")[0] == group for a in getattr(args, "overrides", []))
    if group == "strategy" and (line := lightning_name_line(option)):
        return line
    parent = defaults_list_parent(first)
    plugin = f"hydra-{option.partition('_')[0]}-launcher"  # the name of Hydra's launcher plugin packages
    installed = importlib.util.find_spec(f"hydra_plugins.{plugin.replace('-', '_')}") is not None
    if group == "hydra/launcher" and not installed and (advice := install_advice(plugin)):  # one of dpddp's extras
        given = parent.rpartition("/")[2] if parent and parent.startswith(group) else option  # slurm: submitit_*
        return f"{group}={given} needs {plugin}, which is not installed: {advice}"
    where = "" if typed or parent is None else f" (in the defaults list of {parent})"
    return unknown_line(group, option, known, where)


def unreadable_override(argv: list[str]) -> str | None:
    """One line naming the first override of ``argv`` Hydra's grammar cannot read, with its reason; else ``None``."""
    args = hydra_command_line(argv)
    parser = OverridesParser.create()
    for given in args.overrides if args is not None else []:
        try:
            parser.parse_overrides([given])
        except OverrideParseException as err:
            reason = hydra_override_reason(str(err)) or "not an override"
            fix = "write key=value, quoting a value with special characters (key='a,b')"
            see = "https://hydra.cc/docs/advanced/override_grammar/basic/"
            return f"{given!r} cannot be read as an override ({reason}): {fix}; see {see}"
    return None


def refused_override(override: Any, cfg: DictConfig, err: Exception) -> str:
    """One line for Hydra's parsed ``override`` it refused to apply to ``cfg`` (``err``): what to write instead."""
    line, key = override.input_line, override.key_or_group
    if override.package is not None:
        return f"{line}: there is no config group {key} for @ to place: give a config group, or a key without @"
    if override.is_delete():
        if OmegaConf.select(cfg, key, throw_on_missing=False) is None:
            return f"{line}: the config has no {key} to delete{key_hints(key, cfg)}: drop it, or give a key it has"
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        return f"{line}: {key} is {value!r}, not {override.value()!r}: write ~{key} to delete it whatever its value"
    if override.is_add():
        return f"{line}: the config already has {key}: set it with {line[1:]} (or ++{line[1:]}: add or set)"
    cause = err.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        instead = key_hint(cfg, key)  # what works where +key would not
        section, _, rest = key.partition(".")
        if instead is None and section == "strategy" and rest in DDP_OPTIONS:  # +key's value refused next: now
            try:
                check_strategy_options({rest: override.value()})
            except ConfigError as refused:
                return str(refused)
        if instead is None:
            fix = f"give a key it has, or add a new one with +{line}"
            return f"{line}: the config has no key {key}{key_hints(key, cfg)}: {fix}"
        if (near := re.fullmatch(r"did you mean (\w+)\?", instead)) and f"{near[1]}.{rest}" in dotted_keys(cfg):
            instead = f"did you mean {near[1]}.{rest}?"  # mdoel.lr: model.lr, not model
        return f"{line}: the config has no key {key}{key_hints(key, cfg, instead)}: {instead}"
    reason = (str(cause or err).splitlines() or [type(err).__name__])[0]
    return f"{line} cannot be applied ({reason}): give {key} a value it takes"


def parsed_sweep(params: Any, arguments: Any) -> list[Override]:
    """The overrides of a sweeper's ``params`` (a mapping or ``None``), then of ``arguments``, parsed."""
    hydra = GlobalHydra.instance()
    loader = hydra.config_loader() if hydra.is_initialized() else None
    lines = [f"{k}={v}" for k, v in (params or {}).items()] + list(arguments)
    return OverridesParser.create(config_loader=loader).parse_overrides(lines)


def sweep_variants(config: DictConfig) -> list[list[str]]:
    """The overrides of a basic sweep's first job of each combination of group options (``[]``: one job, or none)."""
    choices = config.hydra.runtime.choices
    if choices.get("hydra/sweeper") != "basic":
        return []
    lists: dict[str, list[str]] = {}  # Hydra's basic sweeper: a key given twice keeps its last values
    for override in parsed_sweep(config.hydra.sweeper.get("params"), config.hydra.overrides.task):
        key = override.get_key_element()
        if not override.is_sweep_override():
            lists[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            lists[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            return []  # a range the basic sweeper refuses itself
    jobs = [list(job) for job in itertools.product(*lists.values())]
    firsts: dict[tuple[str, ...], list[str]] = {}
    for job in jobs if len(jobs) > 1 else []:
        groups = tuple(o for o in job if o.partition("=")[0].lstrip("+~").partition("@")[0] in choices)
        firsts.setdefault(groups, job)
    return list(firsts.values())


# Lines of a jsonargparse error that say nothing of the option given.
BOILERPLATE = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "Expected a <class 'NoneType'>")


def argument_error(message: str, args: list[str], options: list[str], prog: str) -> str:
    """One line for jsonargparse's refusal ``message`` of ``args`` of ``prog`` (``options``: dotted, no ``--``)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head, see = (lines or [message])[0], f"see {prog} --help"
    if (given := unrecognized(head)) is not None:
        name = given.split()[0].split("=")[0].lstrip("-")
        near = difflib.get_close_matches(name, options, n=1, cutoff=0.8)
        first, _, rest = name.partition(".")  # modle.lr: the near group with the rest
        groups = [o for o in options if "." not in o]
        group = difflib.get_close_matches(first, groups, n=1, cutoff=0.6) if rest and not near else []
        nearest = near[0] if near else f"{group[0]}.{rest}" if group else None
        return f"{given}: no such option{f' (nearest: --{nearest})' if nearest else ''}: {see}"
    inner = [line.lstrip("- ") for line in lines[1:] if not line.lstrip("- ").startswith(BOILERPLATE)]
    said = jsonargparse_refusal([head, *inner])
    if said.group_key is not None:  # a key of a --config file
        near = difflib.get_close_matches(said.group_key, options, n=1, cutoff=0.8)
        where = f"{said.group_key} (in a --config file)"
        return f"{where}: no such option{f' (nearest: {near[0]})' if near else ''}: {see}"
    key, option, cls = said.key, said.option, said.class_path
    if key is None:
        return f"{head}: {see}"
    name = key.split(".")[0]
    typed = [a for a in args if re.match(rf"--{re.escape(key)}(\.|\+?=|$)", a)]
    given = typed[-1] if typed else f"--{key}"  # from a --config file: the key
    if option is not None and cls is not None:
        params = [p for p in inspect.signature(get_class(cls)).parameters if p not in ("self", "args", "kwargs")]
        near = difflib.get_close_matches(option, params, n=1, cutoff=0.8)
        hint = f"did you mean --{name}.{near[0]}?" if near else f"its options: {', '.join(params)}"
        return f"{given}: {cls} takes no {option} ({hint}): give one of its options, or another --{name}=pkg.Class"
    flag = key.removeprefix("trainer.")
    if name == "trainer" and option is None and cls is None and (accepts := takes(flag)):
        return f"{given} is invalid: pl.Trainer takes {accepts} for {flag}: {see}"
    if said.expected:
        return f"{given} is invalid (expected {' or '.join(said.expected)}): give a value of that type, {see}"
    detail = said.reason or said.detail
    if cls is not None:
        cause = said.cause or detail
        return f"{given}: {cls} cannot be used ({cause}): give an importable class, e.g. --{key}=pkg.Class"
    return f"{given}: {detail or head}: {see}"


SAMPLING = ("dpddp_optuna",)  # the hydra/sweeper options that sample a search space


def sweep_refusal(config: DictConfig) -> str | None:
    """One line for the first sweep override of ``config`` its sweeper cannot run; else ``None``."""
    choices = config.hydra.runtime.choices
    sweeper = choices.get("hydra/sweeper")
    if sweeper != "basic" and sweeper not in SAMPLING:
        return None
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    for override in parsed_sweep(config.hydra.sweeper.get("params"), config.hydra.overrides.task):
        if override.is_sweep_override() and (line := _refused(override, sweeper == "basic", choices, loader)):
            return line
    return search_refusal(config.hydra.sweeper, list(config.hydra.overrides.task)) if sweeper in SAMPLING else None


def search_refusal(settings: Mapping[str, Any], arguments: Sequence[str]) -> str | None:
    """One line for what the Optuna search cannot run (Optuna missing, a setting, an interval tag); else ``None``."""
    if importlib.util.find_spec("optuna") is None:
        return f"hparams_search=optuna needs Optuna: {install_advice('optuna') or 'pip install optuna'}"
    if settings.get("direction") not in ("minimize", "maximize"):
        direction = f"hydra.sweeper.direction={settings.get('direction')}"
        return f"{direction}: the search optimises one objective: give minimize or maximize"
    for key in ("n_trials", "n_jobs"):
        if not isinstance(settings.get(key), int) or settings[key] < 1:
            return f"hydra.sweeper.{key}={settings.get(key)}: give a positive number of trials"
    if not settings.get("storage"):
        given = f"hydra.sweeper.storage={settings.get('storage') or 'null'}"
        fix = "keep the default (sqlite:///<sweep dir>/optuna.db) or give a database URL"
        return f"{given}: a search without a storage cannot continue after a stop: {fix}"
    for override in parsed_sweep(settings.get("params"), arguments):
        value = override.value() if override.is_interval_sweep() else None
        if isinstance(value, IntervalSweep) and (unknown := set(value.tags) - {"log"}):
            tags = ", ".join(sorted(unknown))
            fix = "give tag(log, interval(a, b)) or interval(a, b)"
            return f"{override.input_line}: the Optuna sweeper knows the interval tag log only, not {tags}: {fix}"
    return None


def _refused(override: Override, basic: bool, choices: Any, loader: Any) -> str | None:
    line, key = override.input_line, override.get_key_element()
    if override.is_interval_sweep():
        if not basic:
            return None
        value = override.value()
        assert isinstance(value, IntervalSweep)
        fix = f"or give a list ({key}={value.start},{value.end})"
        return f"{line}: interval() needs a sampling sweeper (hparams_search=optuna), {fix}"
    values = list(override.sweep_string_iterator())
    is_glob = override.value_type is ValueType.GLOB_CHOICE_SWEEP
    if is_glob and key not in choices:
        return f"{line}: glob() picks options of a config group, and {key} is not one: give a list ({key}=a,b)"
    if is_glob and not values:
        options = ", ".join(loader.get_group_options(key)) if loader is not None else ""
        return f"{line} matches none of the options of {key} ({options}): give a pattern that matches one"
    if not values:
        return f"{line} has no values: give a range whose start is below its stop, e.g. range(1,4)"
    sweep = override.value()
    if isinstance(sweep, RangeSweep) and float in (type(sweep.start), type(sweep.stop)) and len(values) == 1:
        start, stop = float(sweep.start or 0.0), float(sweep.stop or 0.0)
        example = f"{key}=range({start:g},{stop:g},{(stop - start) / 4:g})"
        why = f"range() steps by {sweep.step} unless given a step"
        return f"{line} gives one value ({values[0]}): {why}: give one, e.g. {example}, or list the values"
    if is_glob and not basic:
        choice = f"{key}=choice({','.join(values)})"
        return f"{line}: glob() is the basic sweeper's; a sampling sweeper takes the options as {choice}"
    return None


def sweep_without_multirun(argv: list[str]) -> str | None:
    """One line for the first sweep override of ``argv`` when the command surely runs one job."""
    args = hydra_command_line(argv)
    if args is None or args.multirun or args.help or args.hydra_help or args.info or not sets_no_mode(argv):
        return None
    for override in OverridesParser.create().parse_overrides(list(args.overrides)):
        if not override.is_sweep_override():
            continue
        line, key = str(override.input_line), override.get_key_element()
        value = line.split("=", 1)[1]
        if override.is_interval_sweep():
            return f"{line} is a sweep: add -m hparams_search=optuna to sample it, or give one value"
        if override.value_type is ValueType.SIMPLE_CHOICE_SWEEP:
            one = f"or give one value ({key}=[{value}] is a list, {key}='{value}' a string)"
            return f"{line} is a sweep: add -m to run a job for each value, {one}"
        return f"{line} is a sweep: add -m to run a job for each value, or give one value"
    return None


def repeated_key(config: DictConfig) -> str | None:
    """A warning for the first key a sweep's command line sets twice (Hydra sweeps the last silently), or ``None``."""
    seen: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
        key = override.get_key_element()
        if key in seen:
            return f"warning: {key} is given twice ({seen[key]}, then {override.input_line}): the sweep takes the last"
        seen[key] = str(override.input_line)
    return None
