"""Trainer assembly: the strategy, callbacks, logger and plugins of a run, from its config; ``compile``'s model."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import KubeflowEnvironment
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.loggers.logger import DummyLogger
from omegaconf import DictConfig, OmegaConf

from dpddp._compat import mend_finetuning, mend_swa, skip_empty_batch_hooks, softmax_per_sample
from dpddp.cluster import writes_outputs
from dpddp.continuity.io import AtomicCheckpointIO, IntervalCheckpoints, checkpoint_intervals
from dpddp.continuity.replicas import ReplicaGuard, check_every
from dpddp.continuity.state import ResumableState
from dpddp.continuity.stop import StepBoundaryStop
from dpddp.data.built import SameDataOnEveryRank
from dpddp.data.draws import UnkeyedDraws
from dpddp.data.keys import SampleKeyCallback, uses_sample_keys
from dpddp.diagnostics.costs import Costs
from dpddp.errors import ConfigError, first_line
from dpddp.messages import litlogger_tip
from dpddp.parallel.batchnorm import batchnorm_plugins
from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.dp import DataParallelStrategy, OneProcessStrategy
from dpddp.parallel.launcher import RankJob
from dpddp.parallel.rules import World, is_ddp_family
from dpddp.parallel.workers import start_workers_safely
from dpddp.report.bars import RichBar, TQDMBar
from dpddp.report.contract import LoggedTensors, MetricContract
from dpddp.report.epochs import EpochRecord
from dpddp.report.predictions import PredictionWriter
from dpddp.report.tally import FitTally
from dpddp.report.throughput import Throughput
from dpddp.report.trackers import TrackerRuns, is_tracker, logger_specs, tracker_options
from dpddp.run.build import build
from dpddp.run.draws_seen import draws_line, find_draws
from dpddp.run.executions import StepsPerExecution
from dpddp.run.trainer_flags import TRAINER_ERRORS

log = logging.getLogger(__name__)


# Known-harmless messages of Lightning and torch, each silenced by its own text only (Lightning 2.6.6, torch 2.13;
# tests/test_progress.py counts the warning lines of a default run). Why each is harmless: docs/design-notes.md.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: not litlogger_tip(str(record.msg)))
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
warnings.filterwarnings("ignore", message="Couldn't infer the batch indices fetched from your dataloader")
warnings.filterwarnings("ignore", message="The dirpath has changed from")
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def epoch_lines(cfg: Mapping) -> bool:
    """Whether the run logs a line per epoch (``auto``: stdout is not a terminal); else ``ConfigError``."""
    value = cfg.get("epoch_lines", "auto")
    if value not in ("auto", True, False):
        raise ConfigError(f"epoch_lines={value!r} is invalid: use auto (if stdout is not a tty), true or false")
    return value is True or (value == "auto" and not sys.stdout.isatty())


MODES = ("default", "lite", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def compile_mode(cfg: Mapping) -> str | None:
    """``cfg["compile"]``'s ``torch.compile`` mode (``None``: eager; ``true``: ``"default"``), else ``ConfigError``."""
    value = cfg.get("compile", False)
    if isinstance(value, bool) or (isinstance(value, str) and value in MODES):
        return "default" if value is True else value or None
    raise ConfigError(
        f"compile={value!r} is not offered: use compile=true (torch.compile's default mode), a mode "
        f"({', '.join(MODES)}) or compile=false"
    )


def compile_model(model: pl.LightningModule, mode: str | None) -> None:
    """Bind ``model`` its class's ``forward`` compiled in ``mode`` (``None``: none), an earlier job's graphs dropped."""
    if mode is None:
        return
    torch.compiler.reset()  # an earlier job's graphs count towards torch's recompile limit
    forward = torch.compile(type(model).forward, mode=mode)
    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    if writes_outputs():  # once per run
        log.info(f"compile={mode}: {type(model).__name__}'s forward is compiled by torch.compile at its first call")


def build_strategy(cfg: DictConfig, job: RankJob | None) -> pl.strategies.Strategy:
    """The Trainer's strategy; ``ddp_spawn``: fresh interpreters, so a SIGTERM to the parent still stops them."""
    options: Any = OmegaConf.to_container(cfg.strategy, resolve=True)  # resolved, as the checks read them
    name = options.pop("name")
    if name == "dp":
        return DataParallelStrategy(start_workers=start_workers_safely)
    if name == "ddp_spawn":
        options.update(launch="exec", start_method="popen")
    if is_ddp_family(name):
        return DDPStrategy(job=job, **options)
    return OneProcessStrategy(start_workers=start_workers_safely)


def _build_callbacks(
    cfg: DictConfig, world: World, output_dir: Path, executions: StepsPerExecution | None, predicts_forward: bool
) -> list[pl.Callback]:
    """dpddp's own callbacks (the tally first: the reporters read it), then the configured ones, then the stop."""
    steps = executions.steps if executions is not None else 1  # K, resolved (``auto`` is, before the Trainer)
    tally = FitTally(steps)
    throughput = Throughput(tally)
    costs = Costs(throughput.counts)
    epochs = EpochRecord(output_dir, tally, lines=epoch_lines(cfg), costs=costs)
    state = ResumableState(
        throughput.counts,
        epochs,
        seed=cfg.seed,
        steps_per_execution=steps,
        uncounted=(lambda: executions.cut) if executions is not None else (lambda: False),
        launch=world.launch_id,
        guard=(guard := ReplicaGuard(check_every(cfg))),
        batch_size=batch if isinstance(batch := (cfg.data or {}).get("batch_size"), int) else None,
    )
    intervals = IntervalCheckpoints(output_dir / "checkpoints", *checkpoint_intervals(cfg))
    stop = StepBoundaryStop(output_dir / "checkpoints", intervals=intervals)
    callbacks: list[pl.Callback] = [tally, throughput, costs, epochs, state, guard]
    if world.family == "ddp":  # plain tensors logged with sync_dist over processes: exact
        callbacks.append(LoggedTensors())
    if executions is not None:
        callbacks.append(executions)
    callbacks.append(UnkeyedDraws())  # names a data set's draws that no keyed fetch serves
    if world.replicas > 1:
        callbacks.append(SameDataOnEveryRank())  # the ranks' data compared once at a fit's start
    if any(is_tracker(spec) for _, spec in logger_specs(cfg)):
        callbacks.append(TrackerRuns(cfg, output_dir))
    if cfg.predict:  # every callback costs each hook of each step, even one it does not override
        scores = "out" if predicts_forward else "prob"
        callbacks.append(PredictionWriter(output_dir, scores=scores, forward=predicts_forward))
    settings: dict[int, str] = {}
    last: list[pl.Callback] = []  # written after every other checkpoint's epoch end: last.ckpt has their states
    for key, spec in (cfg.get("callbacks") or {}).items():
        if spec is None:
            continue
        callback = build(spec, f"callbacks.{key}")
        if isinstance(callback, ModelCheckpoint):
            _own_checkpoint(callback, f"callbacks.{key}", output_dir / "checkpoints", [*callbacks, *last])
        (last if key == "last_checkpoint" else callbacks).append(callback)
        settings[id(callback)] = f"callbacks.{key}"
    # The stop's step-end checkpoint follows every other callback's on_train_batch_end (an EMA's update).
    callbacks += [stop, *last]
    keeps = (cfg.trainer or {}).get("enable_checkpointing") is not False  # false: no checkpoint wanted
    if keeps and not any(_writes_last(cb, output_dir / "checkpoints") for cb in callbacks) and world.writes_outputs:
        log.warning(
            "no callback writes checkpoints/last.ckpt each epoch (callbacks.last_checkpoint is dropped): a run killed "
            "(SIGKILL, out of memory) cannot be continued, resume=true starts it fresh; a SIGTERM still writes it"
        )
    for contract in (cb for cb in callbacks if isinstance(cb, MetricContract)):
        contract.settings = settings  # its messages name the setting of a callback's monitor
    return callbacks


def _writes_last(callback: pl.Callback, dirpath: Path) -> bool:
    """Whether ``callback`` writes ``dirpath/last.ckpt``, what a resume continues from."""
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        return False
    here = os.path.realpath(callback.dirpath) == os.path.realpath(dirpath)
    return here and (callback.filename == "last" or bool(callback.save_last))


def _own_checkpoint(callback: ModelCheckpoint, setting: str, dirpath: Path, others: list[pl.Callback]) -> None:
    """Default ``callback``'s ``dirpath`` to ``dirpath``; a state key taken by ``others`` gets ``setting`` in it."""
    if callback.dirpath is None:
        callback.dirpath = os.path.realpath(dirpath)
    if any(cb.state_key == callback.state_key for cb in others):
        base = type(callback)
        key = f"{callback.state_key}[{setting}]"
        callback.__class__ = type(base.__name__, (base,), {"state_key": property(lambda self: key)})


def _build_logger(cfg: DictConfig, output_dir: Path, world: World) -> Any:
    """The ``logger`` group's loggers under ``output_dir`` (else ``False``); a tracker where outputs are written."""
    loggers = []
    for key, spec in logger_specs(cfg):
        kind = is_tracker(spec)
        if kind is None:
            loggers.append(build(spec, key, save_dir=str(output_dir)))
        elif world.writes_outputs:
            loggers.append(build(spec, key, save_dir=str(output_dir), **tracker_options(kind, spec, output_dir, key)))
    if logger_specs(cfg) and not loggers:  # trackers only, on a rank that opens none: one that logs nothing, so
        loggers.append(DummyLogger())  # that a callback that needs a logger runs on every rank
    return loggers or False


def _warn_global_rng(model: pl.LightningModule, datamodule: pl.LightningDataModule, world: World) -> None:
    """Warn once when ``model``'s training step draws from the global streams and the run has several replicas."""
    count = world.replicas
    if count < 2 or not world.writes_outputs:
        return
    draws = find_draws(model, datamodule)
    if isinstance(draws, str):
        log.warning(
            f"could not run a training step before the fit to find draws from the global random streams ({draws}): "
            f"with {count} replicas, any such draw makes the weights differ from one process's"
        )
    elif draws:
        log.warning(
            f"{draws_line(draws)}: with {count} replicas the weights differ from one process's (a continued run on "
            "the same world size still equals a straight one)"
        )


def build_trainer(
    cfg: DictConfig,
    world: World,
    output_dir: Path,
    job: RankJob | None = None,
    executions: StepsPerExecution | None = None,
    *,
    model: pl.LightningModule | None = None,
    predicts_forward: bool = False,
    datamodule: pl.LightningDataModule | None = None,
) -> pl.Trainer:
    """The ``pl.Trainer`` of ``cfg`` on its ``world``, ``executions`` among its callbacks; ``ConfigError``: a flag."""
    softmax_per_sample()  # a torchmetrics metric fed logits: the same value however a batch is chunked
    flags = {k: v for k, v in (cfg.trainer or {}).items() if k != "enable_progress_bar"}
    bar = (cfg.trainer or {}).get("enable_progress_bar")  # null: Lightning's bar on a terminal only
    bar = sys.stdout.isatty() if bar is None else bool(bar)
    bars = [RichBar(refresh_rate=10) if importlib.util.find_spec("rich") else TQDMBar()] if bar else []
    if executions is not None:  # it clips (Lightning refuses clipping under the manual optimization it runs)
        flags = {k: v for k, v in flags.items() if k not in ("gradient_clip_val", "gradient_clip_algorithm")}
    batchnorm = batchnorm_plugins(cfg, world, model)  # before the Trainer: its refusals are dpddp's own lines
    sample_keys = [SampleKeyCallback()] if model is not None and uses_sample_keys(model) else []
    if model is not None and datamodule is not None:
        _warn_global_rng(model, datamodule, world)
    logger = _build_logger(cfg, output_dir, world)  # before the Trainer: a missing tracker package is its own line
    callbacks = _build_callbacks(cfg, world, output_dir, executions, predicts_forward)  # a ConfigError of its own
    try:
        trainer = pl.Trainer(
            **{**flags, "sync_batchnorm": False},  # BatchNorm: batchnorm_plugins below, on any backend
            enable_progress_bar=bar,
            strategy=build_strategy(cfg, job),
            accelerator=world.accelerator,
            devices=cfg.devices,
            num_nodes=cfg.num_nodes,
            logger=logger,
            callbacks=[*callbacks, *sample_keys, *bars],
            default_root_dir=str(output_dir),
            use_distributed_sampler=False,
            # Lightning no longer auto-detects Kubeflow's PyTorchJob; the others (torchrun, SLURM) it does.
            plugins=[
                AtomicCheckpointIO(),
                *([KubeflowEnvironment()] if cfg.cluster == "kubeflow" else []),
                *batchnorm,
            ],
        )
    except TRAINER_ERRORS as err:  # the flags alone passed check_config: with the strategy or plugins, Lightning's line
        raise ConfigError(f"trainer: {first_line(err)}") from err
    skip_empty_batch_hooks(trainer.callbacks)  # type: ignore[attr-defined]  # Lightning's default ones included
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, BaseFinetuning):
            mend_finetuning(callback)
        elif isinstance(callback, StochasticWeightAveraging):
            mend_swa(callback)
    return trainer
