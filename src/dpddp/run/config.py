"""``check_config``: a bad setting is one ``ConfigError`` line (setting, value, fix) before anything starts."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import math
import re
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.imports import RequirementCache
from omegaconf import DictConfig, OmegaConf
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from torch.utils.data import IterableDataset

from dpddp._compat import locate
from dpddp.continuity.io import (
    CHECKPOINT_KEYS,
    CheckpointFacts,
    ConfiguredModel,
    checkpoint_intervals,
    checkpoint_problem,
    readable,
)
from dpddp.continuity.replicas import check_every
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.memory import check_memory, memory_bytes
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.data.rules import check_divides, check_micro_batch_size, check_random_tensors, iterable_refusal
from dpddp.data.sharded import ShardedDataModule
from dpddp.data.streams import StreamDataModule
from dpddp.errors import ConfigError, checked_float, checked_int, unwritable
from dpddp.messages import omegaconf_reason
from dpddp.models.classifier import OPTIMIZERS, Classifier
from dpddp.parallel.rules import DDP_FAMILY, World, resolve_world
from dpddp.report.trackers import logger_specs
from dpddp.run.assembly import compile_mode, epoch_lines
from dpddp.run.build import build
from dpddp.run.keys import TOP_LEVEL_KEYS, allowed_keys, check_keys, check_targets, target_class, with_defaults
from dpddp.run.trainer_flags import refused_flag


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
            if path[0] == "model" and value == f"${{data.{path[-1]}}}":  # the model's sizes follow the data's
                fix = (
                    f"the data has no {path[-1]} to follow: give the model's sizes (model.num_features=<features per "
                    "sample> model.num_classes=<classes>), or, for a class that takes neither, give model a yaml of "
                    "its own (conf/model/<name>.yaml)"
                )
            elif env := re.search(r"\$\{oc\.env:([^,}]+)", value):
                fix = f"set {env.group(1)} in the environment, or give a default: ${{oc.env:{env.group(1)},<default>}}"
            else:
                fix = "give a value, or interpolate a key that exists (e.g. ${data.num_features})"
            raise ConfigError(f"{dotted}={value!r} cannot be resolved ({reason}): {fix}") from err


def _check_val_interval(trainer: Mapping, batches: int) -> None:
    """An integer ``val_check_interval`` above an epoch's ``batches`` (Lightning's check, inside the fit)."""
    interval, every = trainer.get("val_check_interval"), trainer.get("check_val_every_n_epoch", 1)
    if not isinstance(interval, int) or isinstance(interval, bool) or every is None:
        return
    limit = trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    if interval > batches:
        raise ConfigError(
            f"trainer.val_check_interval={interval} is more than the {batches} training batches of an epoch: use at "
            f"most {batches}, a fraction (e.g. 0.5), or trainer.check_val_every_n_epoch=null"
        )


def _check_data(cfg: Mapping, n_procs: int) -> None:
    """``ConfigError``: data ``n_procs`` processes would each run whole, a stream as a data set, no data set class."""
    cls = target_class("data", cfg["data"])
    if n_procs > 1 and not issubclass(cls, (GlobalBatchDataModule, ShardedDataModule, StreamDataModule)):
        raise ConfigError(
            f"data._target_={cfg['data']['_target_']} would give each of {n_procs} processes every batch: shard it "
            "with data=sharded +data.module._target_=<it> (dpddp fit: --data=dpddp.data.sharded.ShardedDataModule "
            "--data.module=<it>; its batch_size is the global batch), or base it on GlobalBatchDataModule"
        )
    dataset = cfg["data"].get("dataset")
    if isinstance(dataset, Mapping) and dataset.get("_target_"):  # a stream: refused before anything starts
        if issubclass(stream := target_class("data.dataset", dataset), IterableDataset):
            raise ConfigError(iterable_refusal(stream.__name__))
    for key, base in (("dataset", GlobalBatchDataModule), ("stream", StreamDataModule)):
        given = cfg["data"].get(key)
        named = given.get("_target_") if isinstance(given, Mapping) else given  # a class's spec, or an object
        if cls is base and named is None:
            plus = "" if isinstance(given, Mapping) and "_target_" in given else "+"  # Hydra adds an absent key with +
            shown = "null" if given is None else given
            raise ConfigError(
                f"data.{key}={shown} names no class ({cls.__name__} has no data set): give {plus}data.{key}._target_="
                f"my_pkg.My{key.capitalize()} (its arguments as +data.{key}.<arg>=...; dpddp fit: --data.{key}="
                f"my_pkg.My{key.capitalize()})"
            )


# Settings that cannot keep the promises with K > 1, micro-batches or compile: (setting, the values that can, why).
EXECUTION_LIMITS = (
    ("trainer.accumulate_grad_batches", (None, 1), "an execution takes one optimizer step per global batch"),
    ("trainer.val_check_interval", (None, 1.0), "validation runs at epoch ends"),
    ("trainer.profiler", (None,), "its rows would count executions of K steps, not steps"),
    ("trainer.limit_train_batches", (None, 1.0), "an epoch is all its global batches"),
    ("trainer.fast_dev_run", (None, False), "it runs one batch of each stage, not one execution of K"),
    ("strategy", ("auto", *DDP_FAMILY), "DataParallel would split an execution's steps over its devices"),
)


def _broken_limit(cfg: Mapping, limits: tuple) -> tuple[str, str] | None:
    """The first of ``limits`` (setting, the values that can, why) that ``cfg`` breaks: ``(setting=value, why)``."""
    for name, ok, why in limits:
        section, _, key = name.rpartition(".")
        value = (cfg[section] or {}).get(key) if section else cfg["strategy"]["name"]
        if value not in ok:
            return f"{name}={value!r}", why
    return None


def _check_limits(cfg: Mapping, limits: tuple, setting: str, fix: str) -> None:
    """``ConfigError`` for the first of ``limits`` that ``cfg`` breaks with ``setting`` given; ``fix`` ends the line."""
    if broken := _broken_limit(cfg, limits):
        raise ConfigError(f"{broken[0]} cannot be kept with {setting} ({broken[1]}): remove it, or {fix}")


def execution_refusal(cfg: Mapping) -> str | None:
    """Why ``cfg`` cannot run with ``steps_per_execution`` above 1 (``"<setting>=<value>: <why>"``), or ``None``."""
    if broken := _broken_limit(cfg, EXECUTION_LIMITS):
        return ": ".join(broken)
    if not issubclass(target_class("data", cfg["data"]), GlobalBatchDataModule):
        return f"data._target_={cfg['data']['_target_']}: not a dpddp.data.global_batch.GlobalBatchDataModule"
    if (collate := cfg["data"].get("collate_fn")) is not None:
        return f"data.collate_fn={collate}: a collated batch (padded per batch) is not stacked into an execution"
    for key, spec in (cfg.get("callbacks") or {}).items():
        if spec is not None and issubclass(target_class(f"callbacks.{key}", spec), StochasticWeightAveraging):
            why = "its learning-rate schedule steps only under automatic optimization"
            return f"callbacks.{key}._target_={spec['_target_']}: {why}"
    return None


MICRO_BATCH_LIMITS = (
    ("trainer.accumulate_grad_batches", (None, 1), "a split step is one optimizer step per global batch"),
    ("strategy", ("auto", *DDP_FAMILY), "DataParallel splits each batch over its devices itself"),
)
UNCOMPILED = "DataParallel's replicas run the model's forward uncompiled; ddp compiles it on every rank"
COMPILE_LIMITS = (("strategy", ("auto", *DDP_FAMILY), UNCOMPILED),)  # with compile: as MICRO_BATCH_LIMITS


def check_precision(cfg: Mapping, world: World) -> None:
    """``ConfigError`` for a precision with 16-bit weights over several replicas (16-bit gradient sums drift)."""
    precision, count = str((cfg["trainer"] or {}).get("precision")), world.replicas
    half = ("16-true", "bf16-true", "transformer-engine", "transformer-engine-float16")  # 16-bit weights
    if precision in half and count > 1:
        where = f"{count} GPUs under strategy=dp" if world.family == "dp" else f"{count} processes"
        raise ConfigError(
            f"trainer.precision={precision} with {where}: the weights and the gradient all-reduce would be 16-bit: use "
            f"trainer.precision=bf16-mixed (or 16-mixed on GPUs), or one device with trainer.precision={precision}"
        )


def needs_logger(cls: type) -> bool:
    """Whether a method of ``cls`` (or a base) raises under Lightning's ``if not trainer.loggers``, read from source."""
    for base in cls.__mro__:
        if base in (pl.Callback, object):
            continue
        for attr in vars(base).values():
            func = getattr(attr, "__func__", getattr(attr, "fget", attr))
            code = getattr(func, "__code__", None)
            if code is None or not {"logger", "loggers"} & set(code.co_names):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
            except (OSError, TypeError, SyntaxError):  # no source (a C or a dynamic function): nothing to read
                continue
            for test in (n for n in ast.walk(tree) if isinstance(n, ast.If)):
                no_logger = re.fullmatch(r"not [\w.]+\.loggers?|[\w.]+\.logger is None", ast.unparse(test.test))
                if no_logger and any(isinstance(r, ast.Raise) for stmt in test.body for r in ast.walk(stmt)):
                    return True
    return False


CLI_CALLBACKS = "cli_"  # how the keys of the Lightning CLI's --trainer.callbacks begin in the run config


def _check_callback_needs(cfg: Mapping) -> None:
    """A callback Lightning refuses without a logger (``needs_logger``), with ``logger=none``."""
    if logger_specs(cfg):
        return
    for key, spec in (cfg.get("callbacks") or {}).items():
        if not spec or not needs_logger(cls := target_class(f"callbacks.{key}", spec)):
            continue
        if str(key).startswith(CLI_CALLBACKS):  # the Lightning CLI's: in its own terms
            raise ConfigError(
                f"--trainer.callbacks ({cls.__name__}) needs a logger, and the run has none: add "
                "--trainer.logger=CSVLogger --trainer.logger.save_dir=. (or TensorBoardLogger, MLFlowLogger, "
                "WandbLogger), or drop the callback"
            )
        raise ConfigError(
            f"callbacks.{key} ({cls.__name__}) needs a logger, and logger=none: use logger=csv (or tensorboard, "
            f"mlflow, wandb), or drop it with callbacks.{key}=null"
        )


def check_model_callbacks(cfg: Mapping, model: pl.LightningModule, trainer: pl.Trainer) -> None:
    """``ConfigError`` for a callback ``model.configure_callbacks()`` returns that needs a logger, with none."""
    if logger_specs(cfg) or not is_overridden("configure_callbacks", model):
        return
    model.trainer = trainer
    returned = model.configure_callbacks()
    for callback in returned if isinstance(returned, Sequence) else [returned]:
        if needs_logger(type(callback)):
            raise ConfigError(
                f"{type(model).__name__}.configure_callbacks() returns {type(callback).__name__}, which needs a "
                "logger, and logger=none: use logger=csv (or tensorboard, mlflow, wandb), or leave it out of "
                "configure_callbacks"
            )


@dataclass(frozen=True)
class Plan:
    """``check_config``'s result, handed down; ``checkpoint``: the continued checkpoint's facts, read once."""

    cfg: Any
    stage: str
    world: World
    checkpoint: CheckpointFacts | None = None


# Counts Lightning takes unchecked, or divides by mid-fit: (trainer flag, the other values taken, what to give instead).
TRAINER_COUNTS = (
    ("accumulate_grad_batches", (None,), "use a positive number of batches per optimizer step"),
    ("max_epochs", (None, -1), "use a positive number (0 trains nothing), or -1 for no limit"),
    ("max_steps", (None, -1), "use a positive number, or -1 for no limit"),
    ("check_val_every_n_epoch", (None,), "use a positive number of epochs, or null with trainer.val_check_interval=N"),
)


def check_config(cfg: DictConfig, stage: str = "fit") -> Plan:
    """The ``Plan`` of a composed config for ``stage``; ``ConfigError`` for its first bad setting or checkpoint."""
    return Plan(cfg, stage, _check_settings(cfg), check_checkpoint(cfg, stage, None))


def install_advice(package: str) -> str | None:
    """``pip install ...`` for ``package`` where dpddp's metadata has it as an extra's requirement; else ``None``."""
    try:
        requirements = [Requirement(line) for line in importlib.metadata.requires("dpddp") or []]
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requirements:
        extra = re.search(r'extra == "(\w+)"', str(req.marker))
        if extra and canonicalize_name(req.name) == canonicalize_name(package):
            return f"pip install '{req.name}{req.specifier}' (or the extra: pip install -e '.[{extra[1]}]')"
    return None


def _check_packages(cfg: Mapping) -> None:
    """``ConfigError`` for a logger or callback whose class's ``__init__`` needs a package not installed."""
    specs = [*logger_specs(cfg), *((f"callbacks.{k}", s) for k, s in (cfg.get("callbacks") or {}).items())]
    for key, spec in specs:
        if not isinstance(spec, Mapping) or not isinstance(spec.get("_target_"), str):
            continue  # a spec naming no class: refused by its own check
        needs = []  # Lightning's RequirementCache flags each class's __init__ tests: one present is enough
        for base in getattr(locate(str(spec["_target_"])), "__mro__", ()):
            names = getattr(vars(base).get("__init__"), "__code__", None)
            found = [vars(sys.modules[base.__module__]).get(n) for n in (names.co_names if names else ())]
            needs += [flag for flag in found if isinstance(flag, RequirementCache)]
        if needs and not any(needs):
            wanted = str(needs[0].requirement or needs[0].module)
            package = Requirement(wanted).name
            advice = install_advice(package) or f"pip install '{wanted}'"
            raise ConfigError(f"{key}._target_={spec['_target_']} needs {package}, which is not installed: {advice}")


def _check_settings(cfg: DictConfig) -> World:
    check_resolvable(cfg)
    checked_int("seed", cfg.get("seed"), 0, "use an integer in [0, 2**32 - 1]", high=2**32 - 1)
    check_keys("", [str(k) for k in cfg.keys()], list(TOP_LEVEL_KEYS))
    keys = allowed_keys(cfg)
    for section in ("data", "model", "trainer", "strategy"):
        check_keys(section, (cfg[section] or {}).keys(), keys[section], cfg[section] or {})
    check_targets(cfg)
    _check_packages(cfg)
    cfg = with_defaults(cfg)  # a model or data config may leave any key to its class's defaults
    world = resolve_world(cfg)
    if target_class("data", cfg["data"]) is RandomTensorDataModule:
        num_train = check_random_tensors(cfg["data"], world.world_size, world.world_size_source)[0]
        _check_val_interval(cfg["trainer"] or {}, num_train // cfg["data"]["batch_size"])
        check_memory(cfg["data"], world.processes_per_node, memory_bytes())
    else:
        check_divides(cfg["data"].get("batch_size"), world.world_size, world.world_size_source)
    _check_data(cfg, world.world_size)
    if (given := cfg.get("steps_per_execution", 1)) != "auto":
        k = checked_int("steps_per_execution", given, 1, "use a positive number, e.g. 16, or auto")
        if k > 1:
            _check_limits(cfg, EXECUTION_LIMITS, f"steps_per_execution={k}", "use steps_per_execution=1")
            if refusal := execution_refusal(cfg):  # the limits are kept: the data or a callback
                raise ConfigError(f"steps_per_execution={k} with {refusal}: use steps_per_execution=1")
    check_micro_batch_size(micro := (cfg["data"] or {}).get("micro_batch_size"))
    if micro is not None:
        _check_limits(cfg, MICRO_BATCH_LIMITS, f"data.micro_batch_size={micro}", "remove data.micro_batch_size")
    if (mode := compile_mode(cfg)) is not None:
        setting = "compile=true" if cfg.get("compile") is True else f"compile={mode}"
        _check_limits(cfg, COMPILE_LIMITS, setting, "use compile=false")
    if issubclass(target_class("model", model := cfg["model"]), Classifier):  # the built-in models
        if "optimizer" in model and model["optimizer"] not in OPTIMIZERS:
            raise ConfigError(
                f"model.optimizer={model['optimizer']!r} is unknown: choose one of {', '.join(OPTIMIZERS)}"
            )
        for key, low, high, fix in (
            ("lr", 1e-12, 1e3, "use a learning rate in [1e-12, 1000], e.g. model.lr=0.1"),
            ("momentum", 0.0, 0.999999, "use a momentum in [0, 1)"),
            ("weight_decay", 0.0, 1e3, "use a weight decay in [0, 1000]"),
        ):
            if key in model:
                checked_float(f"model.{key}", model[key], low, high, fix)
        for key in ("num_features", "num_classes"):
            if key in model:
                checked_int(f"model.{key}", model[key], 1, f"keep model.{key}: ${{data.{key}}}")
    for key in ("num_features", "num_classes"):  # linked settings: the model's sizes follow the data's
        if key in cfg["model"] and key in cfg["data"] and cfg["model"][key] != cfg["data"][key]:
            raise ConfigError(
                f"model.{key}={cfg['model'][key]!r} differs from data.{key}={cfg['data'][key]!r}: set data.{key} "
                f"only (model.{key} follows it)"
            )
    if overfit := (cfg["trainer"] or {}).get("overfit_batches"):  # a sequential sampler: the global batch lost
        raise ConfigError(
            f"trainer.overfit_batches={overfit!r} is not offered: Lightning replaces the training sampler for it; "
            f"use trainer.limit_train_batches={overfit!r} trainer.limit_val_batches={overfit!r} instead"
        )
    check_precision(cfg, world)
    if (cfg["trainer"] or {}).get("barebones") is True:  # before Lightning's check: it would not say why
        raise ConfigError(
            "trainer.barebones=True is not offered: Lightning switches off self.log() and checkpointing in it, and "
            "dpddp's outputs are made of them (metrics.json, the epoch lines, last.ckpt): for speed use "
            "trainer.enable_progress_bar=false epoch_lines=false logger=none instead"
        )
    for key, taken, fix in TRAINER_COUNTS:  # before Lightning's check: its line for -5 offers 0
        if (value := (cfg["trainer"] or {}).get(key)) not in taken:
            checked_int(f"trainer.{key}", value, 1, fix)
    if problem := refused_flag(cfg["trainer"] or {}):
        raise ConfigError(problem)
    if (cfg["trainer"] or {}).get("enable_checkpointing") is False:  # Lightning's refusal of the pair names no fix
        found = [
            f"callbacks.{key}"
            for key, spec in (cfg.get("callbacks") or {}).items()
            if spec and issubclass(target_class(f"callbacks.{key}", spec), ModelCheckpoint)
        ]
        if found:
            raise ConfigError(
                f"trainer.enable_checkpointing=False cannot be kept with {', '.join(found)} (ModelCheckpoint "
                "callbacks): drop them too for a run that saves no checkpoint and cannot be continued "
                f"({' '.join(f'{key}=null' for key in found)}), or remove trainer.enable_checkpointing"
            )
    _check_callback_needs(cfg)
    _check_checkpoint_dirs(cfg)
    for key in ("resume", "predict", "print_config", "curves"):  # the top-level switches
        if not isinstance(value := cfg.get(key, False), bool):
            raise ConfigError(f"{key}={value!r} is not a switch: use {key}=true or {key}=false")
    epoch_lines(cfg)  # a switch, or auto
    check_keys("checkpoint", [str(k) for k in cfg.get("checkpoint") or {}], list(CHECKPOINT_KEYS))
    checkpoint_intervals(cfg)
    check_every(cfg)
    if (clip := (cfg["trainer"] or {}).get("gradient_clip_val")) is not None:
        checked_float("trainer.gradient_clip_val", clip, 0.0, math.inf, "use a non-negative norm or value, or null")
    return world


def check_checkpoint(cfg: DictConfig, stage: str, loaded: dict | None) -> CheckpointFacts | None:
    """The ``ckpt_path`` part of ``check_config`` (``loaded``: that file, read); its facts, or ``ConfigError``."""
    ckpt = cfg["ckpt_path"]
    if ckpt is None:
        return None
    if (path := Path(str(ckpt))).is_dir():
        inside = [p for p in (path / "last.ckpt", path / "checkpoints/last.ckpt") if p.is_file()]
        instead = f"ckpt_path={inside[0]}" if inside else "a checkpoint file, e.g. <run dir>/checkpoints/last.ckpt"
        raise ConfigError(f"ckpt_path={str(ckpt)!r} is a directory, not a checkpoint file: give {instead}")
    if not path.is_file():
        raise ConfigError(
            f"ckpt_path={str(ckpt)!r} does not exist: give a checkpoint file, e.g. <run dir>/checkpoints/last.ckpt"
        )
    loaded = readable(ckpt) if loaded is None else loaded
    k = cfg.get("steps_per_execution", 1) if stage == "fit" else None
    if k == "auto":  # the checkpoint's K is reused, unless the config refuses any K above 1
        k = 1 if execution_refusal(cfg) else None
    if problem := checkpoint_problem(
        ckpt,
        (cfg["trainer"] or {}).get("max_epochs"),
        dict(cfg["data"]) if cfg.get("resume") or stage == "eval" else None,  # the run's data, the run's metrics
        k,
        fit=stage == "fit",
        whole=stage == "eval",
        model=_configured_model(cfg),
        batch_size=batch if isinstance(batch := (cfg["data"] or {}).get("batch_size"), int) else None,
        loaded=loaded,
    ):
        raise ConfigError(f"ckpt_path={str(ckpt)!r} {problem}")
    return CheckpointFacts.of(ckpt, loaded)


def _configured_model(cfg: Mapping) -> ConfiguredModel | None:
    """The configured model's ``ConfiguredModel``, built on the meta device; ``None`` where it cannot be built there."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build(cfg["model"], "model", _convert_="all")
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception:  # a model whose constructor needs real tensors (loads weights, moves data) is not checked
        return None
    spec = cfg["model"]
    raw = OmegaConf.to_container(spec, resolve=False)
    assert isinstance(raw, dict)
    settings: dict[str, tuple[str, Any]] = {}
    for key, given in raw.items():
        followed = re.fullmatch(r"\$\{(data\.\w+)\}", given) if isinstance(given, str) else None
        settings[str(key)] = (followed.group(1) if followed else f"model.{str(key)}", spec[key])
    settings.pop("_target_", None)
    return ConfiguredModel(shapes, bool(getattr(model, "strict_loading", True)), settings)


def _unwritable_where(directory: Path) -> str | None:
    """Why ``directory`` (or the nearest existing one above it) cannot be written; nothing is made."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return unwritable(probe)


def _check_checkpoint_dirs(cfg: Mapping) -> None:
    """A callback's local ``dirpath`` can be written (its first save would fail after an epoch)."""
    for key, spec in (cfg.get("callbacks") or {}).items():
        dirpath = spec.get("dirpath") if isinstance(spec, Mapping) else None
        if dirpath and "://" not in str(dirpath) and (why := _unwritable_where(Path(str(dirpath)))):
            raise ConfigError(
                f"callbacks.{key}.dirpath={str(dirpath)!r} cannot be written ({why}): give a directory you can "
                "write, or null for <run dir>/checkpoints"
            )


def check_output_dir(output_dir: Path) -> None:
    """``ConfigError`` when the run directory (or its ``checkpoints/``) cannot be written."""
    checkpoints = output_dir / "checkpoints"
    directory = checkpoints if checkpoints.is_dir() else output_dir
    if why := _unwritable_where(directory):
        last = checkpoints / "last.ckpt"
        elsewhere = f", or continue it in another run directory with ckpt_path={last}" if last.is_file() else ""
        raise ConfigError(f"{str(directory)!r} cannot be written ({why}): make it writable{elsewhere}")
