"""The one function that runs training, for every entry point: ``train.py``, a sweep job, a launched rank and
the Lightning CLI all call ``train``."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from dpddp.cluster import LAUNCHED_ENV, env_rank
from dpddp.errors import ConfigError, Preempted, RankFailed, first_line
from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.launcher import RankJob
from dpddp.run.callbacks import EpochRecord, LastValidation, Throughput
from dpddp.run.checkpoint import AtomicCheckpointIO
from dpddp.run.config import check_config, resolve_accelerator
from dpddp.run.executions import StepsPerExecution
from dpddp.run.plot import can_plot, write_plot
from dpddp.run.trainer import build_trainer

__all__ = ["METRIC_KEYS", "STAGES", "isolated_job", "train", "train_rank"]

log = logging.getLogger(__name__)
# The global-batch data resumes mid-epoch exactly (its sampler skips the batches already trained), which
# Lightning cannot see from a plain DataLoader; its warning would say the opposite.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

METRIC_KEYS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc")
STAGES = ("fit", "validate", "test", "predict")


def train(cfg: DictConfig, output_dir: str | Path, stage: str = "fit", extra: dict | None = None) -> dict[str, Any]:
    """Run ``cfg`` (see ``conf/config.yaml``): check it, build the model and data from their ``_target_``, and
    run ``stage`` under the configured strategy.

    Args:
        cfg: the composed config.
        output_dir: the run directory shared by all ranks; checkpoints, logger files and ``metrics.json`` go
            there (written by global rank 0 only).
        stage: ``"fit"``: fit, then test the final weights (and predict with ``predict=true``); ``"validate"``,
            ``"test"`` or ``"predict"``: that stage alone, on the weights of ``ckpt_path``.
        extra: more entries for ``metrics.json`` (a sweep job records its overrides there).

    Returns:
        The metrics of ``metrics.json`` (the same on every rank: they are synced sums and counts): losses are
        means over samples, accuracies fractions, ``samples_per_sec`` steady-state training samples per second
        over all processes and all segments of the run, ``wall_time_s`` seconds from the call to the end,
        ``train_time_s`` training seconds over all segments (the first fit and each resume; see
        ``EpochRecord``) and ``segments`` their number.

    Also on rank 0: ``<output_dir>/metrics.csv`` (one row per epoch, see ``EpochRecord``) and, when matplotlib
    is installed, ``<output_dir>/curves.png`` (``dpddp.run.plot``).

    Raises:
        ConfigError: a bad setting (see ``dpddp.run.config.check_config``), before any process is started.
        RankFailed: a launched rank ended with a non-zero status and the run failed with it.
        Preempted: stopped by SIGTERM, with a checkpoint to resume from.
    """
    with _sigterm_stops_the_run(Path(output_dir)) as running:
        return _train(cfg, Path(output_dir), stage, extra, running)


@contextmanager
def _sigterm_stops_the_run(output_dir: Path) -> Iterator[dict[str, pl.Trainer]]:
    """Outside the training loop (start-up, the test or predict after the fit), a SIGTERM raises ``Preempted``
    with the run's ``last.ckpt`` (if written) and global step, so every entry point ends with its one line and
    resume command instead of a silent exit 143. Inside the loop ``Preemption`` replaces this handler with its own
    (a stop at a step boundary) and puts it back after. A handler that was there before (a sweep's, which stops
    the sweep as one: ``dpddp.run.sweep_stop``) keeps the signal; Lightning's evaluation loop then ends the stage
    with its ``SIGTERMException`` (a ``SystemExit`` of status 0, which would end a sweep silently), which becomes
    ``Preempted`` too. Yields a dict that takes the run's ``"trainer"``."""
    running: dict[str, pl.Trainer] = {}
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield running
        return

    def preempted() -> Preempted:
        last = output_dir / "checkpoints" / "last.ckpt"
        trainer = running.get("trainer")
        return Preempted(last if last.is_file() else None, trainer.global_step if trainer is not None else 0)

    def stop(signum: int, frame: Any) -> None:
        if callable(previous):
            previous(signum, frame)
            return
        raise preempted()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield running
    except SIGTERMException as err:  # Lightning's evaluation loop ends on a SIGTERM with this SystemExit, status 0
        raise preempted() from err
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train(
    cfg: DictConfig, output_dir: Path, stage: str, extra: dict | None, running: dict[str, pl.Trainer]
) -> dict[str, Any]:
    start = time.perf_counter()
    check_config(cfg, stage)
    if cfg.get("print_config") and env_rank() == 0 and not os.environ.get(LAUNCHED_ENV):  # once per run
        log.info("config:\n" + OmegaConf.to_yaml(cfg, resolve=True))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    steps = cfg.get("steps_per_execution", 1)
    fused: list[pl.Callback] = [StepsPerExecution(model, steps)] if steps > 1 and stage == "fit" else []
    if fused:
        datamodule.steps_per_execution = steps
    job = RankJob(entry=f"{__name__}:train_rank", config=_resolved(cfg, stage), output_dir=str(output_dir))
    trainer = running["trainer"] = build_trainer(cfg, output_dir, job, fused)
    metrics = _run_stages(trainer, model, datamodule, cfg, stage)
    result: dict[str, Any] = {key: metrics.get(key, math.nan) for key in METRIC_KEYS}
    result.update(
        samples_per_sec=metrics.get(Throughput.KEY, math.nan),
        first_step_unix_s=metrics.get(Throughput.FIRST_STEP_KEY),
        train_time_s=metrics.get(EpochRecord.TIME_KEY, math.nan),
        segments=int(metrics[EpochRecord.SEGMENTS_KEY]) if EpochRecord.SEGMENTS_KEY in metrics else 0,
        world_size=trainer.world_size,
        strategy=cfg.strategy.name,
        accelerator=resolve_accelerator(cfg.accelerator),
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        wall_time_s=time.perf_counter() - start,
        **(extra or {}),
    )
    if trainer.is_global_zero:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.json").write_text(json.dumps(strict(result), indent=2, allow_nan=False) + "\n")
        log.info("metrics: " + ", ".join(_shown(k, v) for k, v in result.items()))
        if can_plot() and (output_dir / "metrics.csv").is_file():
            log.info(f"curves: {write_plot(output_dir)}")
    return result


MISSING = {
    "train/": "no training step ran",
    "val/": "no validation ran on the final weights (trainer.limit_val_batches=0, or an empty split)",
    "test/": "no test ran",
    "samples_per_sec": "fewer than two training steps: no steady state to measure",
}


def strict(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` as strict JSON (RFC 8259 has no NaN): a value that does not exist is ``null``, and
    ``"missing"`` says why, e.g. ``{"val/loss": null, ..., "missing": {"val/loss": "no validation ran ..."}}``."""
    missing = {
        key: next((why for prefix, why in MISSING.items() if key.startswith(prefix)), "not measured")
        for key, value in result.items()
        if isinstance(value, float) and not math.isfinite(value)
    }
    out = {key: None if key in missing else value for key, value in result.items()}
    return {**out, "missing": missing} if missing else out


def _shown(key: str, value: Any) -> str:
    """``key=value`` for the log: counts and rates grouped (``samples_per_sec=33,560``), other floats to 4
    significant digits, the first step's time as a local ISO time."""
    if key == "first_step_unix_s":
        return f"first_step={datetime.fromtimestamp(value).isoformat(timespec='seconds')}" if value else "first_step=-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{key}={value:,.0f}" if abs(value) >= 1000 else f"{key}={value:.4g}"
    return f"{key}={value}"


def train_rank(job: RankJob) -> None:
    """A launched rank's share of a run: ``train`` on the job's resolved config (the ``RankJob.entry``)."""
    config = dict(job.config)
    stage = config.pop("_stage", "fit")
    train(OmegaConf.create(config), job.output_dir, stage=stage)


def _resolved(cfg: DictConfig, stage: str) -> dict[str, Any]:
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    return {**config, "_stage": stage}


def _run_stages(
    trainer: pl.Trainer, model: pl.LightningModule, datamodule: pl.LightningDataModule, cfg: DictConfig, stage: str
) -> dict[str, float]:
    """Run ``stage`` (see ``train``); return the callback metrics as floats. A launched rank's death is named."""
    finished = False
    try:
        if stage == "fit":
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
            metrics = _floats(trainer.callback_metrics)
            metrics.update(_final_weights(trainer, model, datamodule))
            if is_overridden("test_step", model):  # a user's model may have none: test/* are then null
                trainer.test(model, datamodule=datamodule, verbose=False)
        elif stage in ("validate", "test"):
            getattr(trainer, stage)(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, verbose=False)
            metrics = {}
        else:
            metrics = {}
        metrics.update(_floats(trainer.callback_metrics))
        if cfg.predict or stage == "predict":
            ckpt = cfg.ckpt_path if stage == "predict" else None
            trainer.predict(model, datamodule=datamodule, return_predictions=False, ckpt_path=ckpt)
        finished = True
        return metrics
    except Exception as err:
        # Name the cause, not the broken connection; a refusal or a preemption is its own answer (no wait).
        supervisor = trainer.strategy.supervisor if isinstance(trainer.strategy, DDPStrategy) else None
        lost = [] if isinstance(err, (ConfigError, Preempted)) or supervisor is None else supervisor.failed_ranks(2.0)
        if lost:
            raise RankFailed(f"{'; '.join(lost)}; ending the run (rank 0: {first_line(err)})") from err
        raise
    finally:
        # Stop watching this job's ranks before the next job of a sweep starts; a failed job's are killed.
        if isinstance(trainer.strategy, DDPStrategy) and trainer.strategy.supervisor is not None:
            trainer.strategy.supervisor.join(timeout_s=60.0 if finished else 5.0)


def _final_weights(
    trainer: pl.Trainer, model: pl.LightningModule, datamodule: pl.LightningDataModule
) -> dict[str, float]:
    """Make the fit's outputs the final weights', whatever stopped it: write ``last.ckpt`` if its last write was
    at another step, and validate if the last validation ran on other weights (a stop by ``max_steps`` or
    ``max_time`` mid-epoch, ``val_check_interval``, ``check_val_every_n_epoch``: case 13). Returns the new
    validation metrics, if it ran one."""
    if trainer.fast_dev_run:  # type: ignore[attr-defined]  # no checkpoint, no more validation (Lightning)
        return {}
    step = trainer.global_step
    io = trainer.strategy.checkpoint_io
    last = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.filename == "last"]
    if last and last[0].dirpath and isinstance(io, AtomicCheckpointIO):
        if trainer.strategy.broadcast(io.saved_steps.get("last.ckpt") != step):  # rank 0 wrote it, if anyone
            trainer.save_checkpoint(Path(last[0].dirpath) / "last.ckpt", weights_only=False)  # explicit: no log line
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    validated = next((cb.step for cb in callbacks if isinstance(cb, LastValidation)), step)
    if validated == step or trainer.limit_val_batches == 0 or not is_overridden("validation_step", model):
        return {}
    trainer.validate(model, datamodule=datamodule, verbose=False)
    return _floats(trainer.callback_metrics)


def _floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: v.item() for k, v in metrics.items()}


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
