"""Trainer assembly: the strategy, callbacks, logger and plugins of a run, from its config."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import KubeflowEnvironment
from omegaconf import DictConfig, OmegaConf

from dpddp.errors import ConfigError
from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.dp import DataParallelStrategy
from dpddp.parallel.launcher import RankJob
from dpddp.run.callbacks import PredictionWriter, Preemption, Throughput
from dpddp.run.checkpoint import AtomicCheckpointIO
from dpddp.run.config import resolve_accelerator

__all__ = ["build_strategy", "build_trainer"]


def build_strategy(cfg: DictConfig, job: RankJob | None) -> str | pl.strategies.Strategy:
    """The Trainer's strategy from the ``strategy`` group: ``"auto"``, our ``dp``, or our ``DDPStrategy``
    (``ddp`` whose launcher starts ranks from ``job``; ``ddp_spawn`` with ``start_method="spawn"``)."""
    container = OmegaConf.to_container(cfg.strategy)
    assert isinstance(container, dict)
    options = {str(k): v for k, v in container.items() if k != "name"}
    name = cfg.strategy.name
    if name == "dp":
        return DataParallelStrategy()
    if name == "ddp":
        return DDPStrategy(job=job, **options)
    if name == "ddp_spawn":
        return DDPStrategy(start_method="spawn", **options)
    return "auto"


def _build_callbacks(cfg: DictConfig, output_dir: Path) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = [Throughput(), Preemption(output_dir / "checkpoints")]
    if cfg.predict:  # every callback costs each hook of each step, even one it does not override
        callbacks.append(PredictionWriter(output_dir))
    for spec in (cfg.callbacks or {}).values():
        if spec is None:
            continue
        extra = {"dirpath": str(output_dir / "checkpoints")} if spec.get("dirpath", False) is None else {}
        callbacks.append(instantiate(spec, **extra))
    return callbacks


def _build_logger(cfg: DictConfig, output_dir: Path) -> Any:
    if not cfg.logger:
        return False
    return instantiate(cfg.logger, save_dir=str(output_dir))


TRAINER_ERRORS = (ValueError, TypeError, pl.utilities.exceptions.MisconfigurationException)


def _trainer_flag_error(cfg: DictConfig, err: Exception) -> ConfigError:
    """Name the ``trainer.*`` flag Lightning refused: try each flag that differs from Lightning's default alone."""
    line = (str(err).splitlines() or [type(err).__name__])[0]
    defaults = inspect.signature(pl.Trainer.__init__).parameters
    for key, value in (cfg.trainer or {}).items():
        if key in defaults and value == defaults[key].default:
            continue
        try:
            pl.Trainer(**{key: value}, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        except TRAINER_ERRORS as alone:
            return ConfigError(f"trainer.{key}={value!r} is invalid: {(str(alone).splitlines() or [''])[0]}")
    return ConfigError(f"trainer: {line}")


def build_trainer(cfg: DictConfig, output_dir: Path, job: RankJob | None = None) -> pl.Trainer:
    """The ``pl.Trainer`` of ``cfg`` (trainer flags passed through; strategy, devices and the rest from the
    top-level knobs; the distributed sampler off: ``RandomTensorDataModule`` shards global batches itself).

    Raises:
        ConfigError: Lightning refused a flag; the message names it.
    """
    try:
        return pl.Trainer(
            **(cfg.trainer or {}),
            strategy=build_strategy(cfg, job),
            accelerator=resolve_accelerator(cfg.accelerator),
            devices=cfg.devices,
            num_nodes=cfg.num_nodes,
            logger=_build_logger(cfg, output_dir),
            callbacks=_build_callbacks(cfg, output_dir),
            default_root_dir=str(output_dir),
            use_distributed_sampler=False,
            # Lightning no longer auto-detects Kubeflow's PyTorchJob; the others (torchrun, SLURM) it does.
            plugins=[AtomicCheckpointIO(), *([KubeflowEnvironment()] if cfg.cluster == "kubeflow" else [])],
        )
    except TRAINER_ERRORS as err:
        raise _trainer_flag_error(cfg, err) from err
