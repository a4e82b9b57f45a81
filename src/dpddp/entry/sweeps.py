"""Hydra's sweep syntax against the sweeper that runs it: what it cannot run is one line before the sweep starts."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, ValueType
from omegaconf import DictConfig

from dpddp._compat import hydra_command_line
from dpddp.entry.command_line import parsed_sweep, sets_no_mode

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
        return "hparams_search=optuna needs Optuna: pip install 'optuna>=4' (or the extra: pip install -e '.[optuna]')"
    if settings.get("direction") not in ("minimize", "maximize"):
        direction = f"hydra.sweeper.direction={settings.get('direction')}"
        return f"{direction}: the search optimises one objective: give minimize or maximize"
    for key in ("n_trials", "n_jobs"):
        if not isinstance(settings.get(key), int) or settings[key] < 1:
            return f"hydra.sweeper.{key}={settings.get(key)}: give a positive number of trials"
    if not settings.get("storage"):
        return (
            f"hydra.sweeper.storage={settings.get('storage') or 'null'}: a search without a storage cannot continue "
            "after a stop: keep the default (sqlite:///<sweep dir>/optuna.db) or give a database URL"
        )
    for override in parsed_sweep(settings.get("params"), arguments):
        value = override.value() if override.is_interval_sweep() else None
        if isinstance(value, IntervalSweep) and (unknown := set(value.tags) - {"log"}):
            return (
                f"{override.input_line}: the Optuna sweeper knows the interval tag log only, not "
                f"{', '.join(sorted(unknown))}: give tag(log, interval(a, b)) or interval(a, b)"
            )
    return None


def _refused(override: Override, basic: bool, choices: Any, loader: Any) -> str | None:
    line, key = override.input_line, override.get_key_element()
    if override.is_interval_sweep():
        if not basic:
            return None
        value = override.value()
        assert isinstance(value, IntervalSweep)
        return (
            f"{line}: interval() needs a sampling sweeper (hparams_search=optuna), or give a list "
            f"({key}={value.start},{value.end})"
        )
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
        return (
            f"{line} gives one value ({values[0]}): range() steps by {sweep.step} unless given a step: give one, "
            f"e.g. {key}=range({start:g},{stop:g},{(stop - start) / 4:g}), or list the values"
        )
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
