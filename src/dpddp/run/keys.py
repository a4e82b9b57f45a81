"""The keys a run config may have (from its classes' signatures), and the advice for an unknown one."""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, open_dict

from dpddp._compat import locate
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.errors import ConfigError, first_line
from dpddp.models.linear import LinearClassifier
from dpddp.parallel.rules import DDP_OPTIONS

GROUPS = ("data", "model", "trainer", "logger", "callbacks")  # the config's sections that are groups
PRESETS = ("experiment", "debug", "hparams_search")  # the groups of presets, merged at the top level
TOP_LEVEL = ("strategy", "accelerator", "devices", "num_nodes", "cluster", "seed", "ckpt_path", "resume", "predict")
TOP_LEVEL_RUN = ("steps_per_execution", "compile", "checkpoint", "check_replicas")  # how training runs, is checked
TOP_LEVEL_OUTPUT = ("epoch_lines", "print_config", "curves", "objective")  # how a run reports progress and its result
TOP_LEVEL_KEYS = (*TOP_LEVEL, *TOP_LEVEL_RUN, *TOP_LEVEL_OUTPUT, *GROUPS)
# Trainer flags owned elsewhere: the top-level knobs, and what the global-batch contract and the run dir need.
TRAINER_OWNED = {
    "strategy": "set it at the top level: strategy=ddp",
    "accelerator": "set it at the top level: accelerator=cpu",
    "devices": "set it at the top level: devices=2",
    "num_nodes": "set it at the top level: num_nodes=2",
    "use_distributed_sampler": "dpddp shards each global batch itself; remove it",
    "logger": "choose a logger group: logger=csv|tensorboard|mlflow|wandb|none",
    "callbacks": "use the callbacks group",
    "default_root_dir": "the run directory is Hydra's: set hydra.run.dir",
}


def _parameters(fn: Any) -> list[inspect.Parameter]:
    """The parameters ``fn`` takes; a class's ``**kwargs`` adds those of the first base with an ``__init__``."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    if isinstance(fn, type) and any(p.kind is p.VAR_KEYWORD for p in params):
        base = next((b for b in fn.__mro__[1:] if "__init__" in vars(b) and b is not object), None)
        names = {p.name for p in params}
        params += [p for p in (_parameters(base) if base is not None else []) if p.name not in names]
    return params


def _params(fn: Any) -> list[str]:
    """The keyword names ``fn`` takes (see ``_parameters``)."""
    return [p.name for p in _parameters(fn) if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def with_defaults(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose ``model`` and ``data`` (whose classes import) also have their classes' plain defaults."""
    filled = copy.deepcopy(cfg)
    plain = (bool, int, float, str, type(None), list, tuple, dict)
    for section in ("model", "data"):
        params = _parameters(target_class(section, cfg[section]))
        missing = {p.name: p.default for p in params if p.default is not p.empty and p.name not in cfg[section]}
        missing = {k: list(v) if isinstance(v, tuple) else v for k, v in missing.items() if isinstance(v, plain)}
        with open_dict(filled):
            filled[section].merge_with(missing)
    return filled


def import_problem(target: str) -> str | None:
    """Why the ``_target_`` ``target`` cannot be imported (in one line, the nearest name included), or ``None``."""
    try:
        locate(target)
        return None
    except Exception as err:
        located = err
    parts, module, i = target.split("."), None, 0
    for i in range(1, len(parts) + 1):  # the longest importable module: then attributes
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
        except Exception as err:
            if not isinstance(err, ModuleNotFoundError) or err.name != name:  # or a module it imports is missing
                return f"importing {name} failed: {first_line(err)}"
            i -= 1
            break
    if module is None:
        return f"no module named {parts[0]}: is it installed, or on PYTHONPATH?"
    obj: Any = module
    for j in range(i, len(parts)):
        if not hasattr(obj, parts[j]):
            names = [n for n in dir(obj) if not n.startswith("_")]
            near = difflib.get_close_matches(parts[j], names, n=1, cutoff=0.6)
            hint = f" (did you mean {'.'.join(parts[:j])}.{near[0]}?)" if near else ""
            return f"{'.'.join(parts[:j])} has no {parts[j]}{hint}"
        obj = getattr(obj, parts[j])
    return (str(located).splitlines() or [type(located).__name__])[0]


def _importable(key: str, target: str) -> None:
    if problem := import_problem(target):
        raise ConfigError(f"{key}._target_={target!r} cannot be imported ({problem}): check the name")


def target_class(section: str, spec: Mapping) -> type:
    """The class ``section``'s ``_target_`` names; ``ConfigError`` if missing, not importable, or not a class."""
    target = spec.get("_target_")
    if not target:
        raise ConfigError(f"{section}._target_ is missing: name the class to build, e.g. {section}._target_=pkg.Class")
    _importable(section, str(target))
    found = locate(str(target))
    if not isinstance(found, type):
        raise ConfigError(f"{section}._target_={target!r} is not a class: name the class to build")
    return found


def missing_argument(node: Mapping, injected: tuple[str, ...] = ()) -> str | None:
    """The first required argument of ``node["_target_"]`` neither ``node`` nor ``injected`` gives, or ``None``."""
    if node.get("_partial_") or node.get("_args_"):
        return None
    try:
        params = inspect.signature(locate(str(node["_target_"]))).parameters.values()
    except (ImportError, ValueError, TypeError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needed = [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name != "self"]
    return next((n for n in needed if n not in node and n not in injected), None)


def check_targets(cfg: Mapping) -> None:
    """``ConfigError`` for the first ``_target_`` in ``cfg`` not importable or lacking a required argument."""

    def walk(node: Any, key: str, injected: tuple[str, ...] = ()) -> None:
        if isinstance(node, Mapping):
            if isinstance(target := node.get("_target_"), str):
                _importable(key, target)
                if name := missing_argument(node, injected):
                    raise ConfigError(f"{key}: {target} needs {name} (it has no default): set +{key}.{name}")
            for name, value in node.items():
                walk(value, f"{key}.{name}", injected if target is None else ())

    for section in ("data", "model", "callbacks", "logger"):  # dpddp gives a logger its save_dir (the run dir)
        walk(cfg.get(section), section, ("save_dir",) if section == "logger" else ())


def allowed_keys(cfg: Mapping | None = None) -> dict[str, list[str]]:
    """Valid keys per section, from its classes' signatures (``model``, ``data``: the built-ins without ``cfg``)."""
    model = target_class("model", cfg["model"]) if cfg else LinearClassifier
    data = target_class("data", cfg["data"]) if cfg else RandomTensorDataModule
    return {
        "": list(TOP_LEVEL_KEYS),
        "data": ["_target_", *_params(data)],
        "model": ["_target_", *_params(model)],
        "trainer": [k for k in _params(pl.Trainer.__init__) if k not in TRAINER_OWNED],
        "strategy": ["name", *DDP_OPTIONS, *_params(torch.nn.parallel.DistributedDataParallel.__init__)[1:]],
    }


def _key_problem(section: str, key: str, allowed: list[str], spec: Mapping | None = None) -> tuple[str, str] | None:
    """``(what is wrong, the fix)`` for ``key`` of ``section`` (given as ``spec``), or ``None`` if ``allowed``."""
    prefix, builtin = f"{section}." if section else "", allowed_keys()[section] if spec is not None else []
    if section == "trainer" and key in TRAINER_OWNED:
        return f"trainer.{key} is not set in the trainer group", TRAINER_OWNED[key]
    if key in allowed:
        return None
    unknown, given = f"unknown setting {prefix}{key}", spec or {}
    if not section and key in PRESETS:  # Hydra put the preset's keys under its group's name
        return unknown, (
            f"the {key}= preset's keys are under {key}. because its file lacks Hydra's package header: make "
            "'# @package _global_' its first line"
        )
    if section and key == "compile":  # a top-level setting looked for in a section (model.compile=true)
        return unknown, "set it at the top level: compile=true (torch.compile of the model's forward)"
    if key not in builtin:
        near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
        return unknown, f"did you mean {prefix}{near[0]}?" if near else f"valid keys: {', '.join(sorted(allowed))}"
    lacks = [str(k) for k in given if k in builtin and k not in allowed and k != "_target_"] or [key]  # all at once
    drops = [f"~{prefix}{k}" for k in lacks if given.get(k) is not None]  # Hydra keeps null
    drop = f", or drop {'them' if len(lacks) > 1 else 'it'} with {' '.join(drops)}" if len(drops) == len(lacks) else ""
    own = f"give {section} a yaml of its own (conf/{section}/<name>.yaml){drop}"
    return unknown, f"{given.get('_target_')} takes no {', '.join(lacks)} (of the packaged config): {own}"


def check_keys(section: str, keys: Iterable[str], allowed: list[str], spec: Mapping | None = None) -> None:
    """Raises ``ConfigError`` for the first of ``keys`` that ``allowed`` lacks, with what to do instead."""
    for key in keys:
        if problem := _key_problem(section, key, allowed, spec):
            raise ConfigError(": ".join(problem))


def key_hint(cfg: Mapping, key: str) -> str | None:
    """``check_config``'s advice for the dotted ``key`` added to ``cfg``; ``None`` when it would take it."""
    section, _, rest = key.partition(".")
    if section == "hydra":
        return None
    if problem := _key_problem("", section, allowed_keys()[""]):
        return problem[1]
    if not rest or section not in allowed_keys():
        return None
    try:
        allowed = allowed_keys(cfg)[section]
    except ConfigError:
        return None
    problem = _key_problem(section, rest.split(".")[0], allowed, cfg.get(section) or {})
    return problem[1] if problem else None
