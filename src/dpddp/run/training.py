"""One run: validate, seed, build, fit, test, write ``metrics.json``; and the Hydra job around it."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import KubeflowEnvironment
from omegaconf import DictConfig, OmegaConf

from dpddp.callbacks import PredictionWriter, Preempted, Preemption, Throughput
from dpddp.checkpoint import AtomicCheckpointIO
from dpddp.config import ConfigError, check_config, resolve_accelerator
from dpddp.data import RandomTensorDataModule
from dpddp.model import LinearClassifier
from dpddp.strategies import DataParallelStrategy, DDPStrategy, RankFailed

__all__ = ["METRIC_KEYS", "build_strategy", "build_trainer", "isolated_job", "train"]

log = logging.getLogger(__name__)
# RandomTensorDataModule resumes mid-epoch exactly (it skips the batches already trained: see train_dataloader),
# which Lightning cannot see from a plain DataLoader; its warning would say the opposite.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

METRIC_KEYS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc")


def build_strategy(cfg: DictConfig, job: dict | None) -> str | pl.strategies.Strategy:
    """The Trainer's strategy from the ``strategy`` group: ``"auto"``, our ``dp``, or our ``DDPStrategy``
    (``ddp`` with the Hydra-safe launcher when ``job`` is given; ``ddp_spawn`` with ``start_method="spawn"``)."""
    options = {k: v for k, v in OmegaConf.to_container(cfg.strategy).items() if k != "name"}
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


def build_trainer(cfg: DictConfig, output_dir: Path, job: dict | None = None) -> pl.Trainer:
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


def train(
    cfg: DictConfig, output_dir: str | Path, job: dict | None = None, extra: dict | None = None
) -> dict[str, Any]:
    """Train ``LinearClassifier`` on ``RandomTensorDataModule`` as ``cfg`` says (see ``conf/config.yaml``).

    Args:
        cfg: the composed config.
        output_dir: the run directory shared by all ranks; checkpoints, logger files and ``metrics.json`` go
            there (written by global rank 0 only).
        job: what launched DDP ranks need to rebuild this run (resolved config and ``output_dir``); ``None``
            outside Hydra jobs.
        extra: more entries for ``metrics.json`` (a sweep job records its overrides there).

    Returns:
        The metrics of ``metrics.json`` (the same on every rank: they are synced sums and counts): losses are
        means over samples, accuracies fractions, ``samples_per_sec`` steady-state training samples per second
        over all processes, ``wall_time_s`` seconds from the call to the end of testing.

    Raises:
        ConfigError: a bad setting (see ``dpddp.config.check_config``), before any process is started.
        RankFailed: a launched rank ended with a non-zero status and the run failed with it.
    """
    start = time.perf_counter()
    check_config(cfg)
    output_dir = Path(output_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = RandomTensorDataModule(**cfg.data)
    model = LinearClassifier(**cfg.model)
    trainer = build_trainer(cfg, output_dir, job)
    finished = False
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
        fit_metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
        trainer.test(model, datamodule=datamodule, verbose=False)
        metrics = {**fit_metrics, **{k: v.item() for k, v in trainer.callback_metrics.items()}}
        if cfg.predict:
            trainer.predict(model, datamodule=datamodule, return_predictions=False)
        finished = True
    except Exception as err:
        # Name the cause, not the broken connection; a refusal or a preemption is its own answer (no wait).
        lost = [] if isinstance(err, (ConfigError, Preempted)) else _failed_ranks(trainer)
        if lost:
            first = (str(err).splitlines() or [""])[0][:200]
            raise RankFailed(f"{'; '.join(lost)}; ending the run (rank 0: {type(err).__name__}: {first})") from err
        raise
    finally:
        # Stop watching this job's ranks before the next job of a sweep starts; a failed job's are killed.
        _join_launched_ranks(trainer, timeout_s=60.0 if finished else 5.0)
    result = {key: metrics.get(key, math.nan) for key in METRIC_KEYS}
    result.update(
        samples_per_sec=metrics.get(Throughput.KEY, math.nan),
        first_step_unix_s=metrics.get(Throughput.FIRST_STEP_KEY),
        world_size=trainer.world_size,
        strategy=cfg.strategy.name,
        accelerator=resolve_accelerator(cfg.accelerator),
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        wall_time_s=time.perf_counter() - start,
        **(extra or {}),
    )
    if trainer.is_global_zero:
        (output_dir / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        log.info(
            "metrics: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
        )
    return result


def _failed_ranks(trainer: pl.Trainer) -> list[str]:
    launcher = trainer.strategy.launcher
    return launcher.failed_ranks(wait_s=2.0) if hasattr(launcher, "failed_ranks") else []


def _join_launched_ranks(trainer: pl.Trainer, timeout_s: float) -> None:
    launcher = trainer.strategy.launcher
    if hasattr(launcher, "join"):
        launcher.join(timeout_s)


@contextmanager
def isolated_job() -> Iterator[None]:
    """Leave nothing of a job behind for the next one in the same process (a Hydra multirun): restore
    ``os.environ`` (Lightning's launcher sets ``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
    ``seed_everything`` sets ``PL_GLOBAL_SEED`` in the parent) and destroy the process group."""
    saved = dict(os.environ)
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
