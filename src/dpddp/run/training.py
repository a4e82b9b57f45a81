"""The one function that runs training, for every entry point (``train``)."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from dpddp._compat import agent_store_shared
from dpddp.cluster import launched_by_dpddp
from dpddp.continuity.state import save_final_checkpoint
from dpddp.continuity.stop import RunScope, StepBoundaryStop, run_stops, starting_up
from dpddp.data.built import data_streams
from dpddp.diagnostics.costs import Costs, peak_memory_mib
from dpddp.errors import ConfigError, Preempted, RankFailed, ReplicasDiverged, first_line
from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.launcher import RankJob
from dpddp.parallel.rules import World
from dpddp.parallel.workers import loader_failed
from dpddp.report.epochs import EpochRecord
from dpddp.report.metrics import METRIC_KEYS, write_metrics
from dpddp.report.predictions import PredictFailed, predict_forward
from dpddp.report.tally import FitTally
from dpddp.report.throughput import Throughput
from dpddp.report.trackers import close_trackers
from dpddp.run.assembly import build_trainer, compile_mode, compile_model
from dpddp.run.auto_steps import resolve_steps
from dpddp.run.build import build
from dpddp.run.config import Plan, check_config, check_model_callbacks, check_output_dir
from dpddp.run.executions import StepsPerExecution

log = logging.getLogger(__name__)
T = TypeVar("T")
# The global-batch data resumes mid-epoch exactly (its sampler skips the batches already trained), which
# Lightning cannot see from a plain DataLoader; its warning would say the opposite.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

STAGES = ("fit", "validate", "test", "predict")


def train(
    cfg: DictConfig, output_dir: str | Path, stage: str = "fit", extra: dict | None = None, plan: Plan | None = None
) -> dict[str, Any]:
    """Run ``stage`` of ``cfg`` on its ``plan`` (``fit``: then test, and predict with ``predict=true``; ``eval``:
    validate and test); ``metrics.json``'s metrics with ``extra``. Raises ConfigError, RankFailed, Preempted."""
    start, output_dir = time.perf_counter(), Path(output_dir)
    with run_stops(output_dir) as running:
        with starting_up(running):  # the check is the start-up's: a SIGTERM in it is held to its end
            plan = plan or check_config(cfg, stage)
            stage, world = plan.stage, plan.world
            _log_world(world, cfg.num_nodes == "auto")
            cfg.num_nodes = world.nodes  # num_nodes=auto: the launcher's, for this start
            if world.writes_outputs:
                check_output_dir(output_dir)
            if cfg.get("print_config") and world.writes_outputs:  # once per run
                log.info("config:\n" + OmegaConf.to_yaml(cfg, resolve=True))
            pl.seed_everything(cfg.seed, workers=True, verbose=False)
            with data_streams(cfg.seed):  # a data set built from the global streams: the same on every rank
                datamodule = build(cfg.data, "data", _convert_="all")
            model = build(cfg.model, "model", _convert_="all")
            forward = bool(cfg.predict or stage == "predict") and predict_forward(model)
            steps, micro = cfg.get("steps_per_execution", 1), getattr(datamodule, "micro_batch_size", None)
            auto = steps == "auto"
            if auto:
                steps = resolve_steps(plan, model, datamodule) if stage == "fit" else 1
                cfg.steps_per_execution = steps  # what the launched ranks' job, the tally and the checkpoint see
            clip = ((cfg.trainer or {}).get("gradient_clip_val"), (cfg.trainer or {}).get("gradient_clip_algorithm"))
            fused = (steps > 1 or micro) and stage == "fit"
            executions = StepsPerExecution(model, steps, micro, clip=clip, auto=auto) if fused else None
            if executions is not None:
                datamodule.steps_per_execution = steps
            compile_model(model, compile_mode(cfg))  # after resolve_steps: steps_per_execution=auto times eager steps
            config: Any = OmegaConf.to_container(cfg, resolve=True)  # its keys, str
            job = RankJob(entry=f"{__name__}:train_rank", config=config, output_dir=str(output_dir), stage=stage)
            trainer = build_trainer(
                cfg, world, output_dir, job, executions, model=model, predicts_forward=forward, datamodule=datamodule
            )
            check_model_callbacks(cfg, model, trainer)
            if executions is not None:
                executions.check_observers(trainer, datamodule)
            running.own(trainer)
        metrics, ran, predict_error = _run_stages(trainer, model, datamodule, plan, running)
        costs, records = _callback(trainer, Costs), _callback(trainer, EpochRecord)
        result: dict[str, Any] = {key: metrics.get(key, math.nan) for key in METRIC_KEYS}
        result.update(
            samples_per_sec=metrics.get(Throughput.KEY, math.nan),
            peak_mem_mib=metrics.get(Costs.MEMORY_KEY, math.nan),
            peak_mem_of=peak_memory_mib(trainer)[1],
            first_step_unix_s=metrics.get(Throughput.FIRST_STEP_KEY),
            train_time_s=metrics.get(EpochRecord.TIME_KEY, math.nan),
            segments=records.table.segments if records else 0,  # the weights' training: a checkpoint's in eval
            segment_world_sizes=list(records.table.world_sizes) if records else [],
            world_size=trainer.world_size,
            strategy=cfg.strategy.name,
            accelerator=world.accelerator,
            devices=cfg.devices,
            num_nodes=cfg.num_nodes,
            precision=str(trainer.precision),  # Lightning's resolved flag: 16-mixed becomes bf16-mixed on CPU
            micro_batch_size=executions.micro_size if executions is not None and executions.micro else None,
            steps_per_execution=steps if stage == "fit" else None,
            wall_time_s=time.perf_counter() - start,
            **(
                {"allreduce_share": metrics.get(Costs.SHARE_KEY, math.nan), **(costs.rank_figures() if costs else {})}
                if isinstance(trainer.strategy, DDPStrategy)
                else {}
            ),
            **(extra or {}),
        )
        result["objective"] = name = objective(cfg)
        if name not in result:  # a name of the user's (callbacks.model_checkpoint.monitor=val_loss)
            result[name] = metrics.get(name, math.nan)
        if predict_error is not None:
            result["predict_error"] = first_line(predict_error)
        reasons, unshown = _missing(trainer, metrics, stage, ran)
        if stage != "fit":  # a stage run alone: its line shows only what it measured
            unshown += tuple(
                k for k, v in result.items() if k == "objective" or (isinstance(v, float) and math.isnan(v))
            )
        if trainer.is_global_zero:
            write_metrics(output_dir, result, reasons, unshown, draw=cfg.get("curves", True))
        if predict_error is not None:
            raise PredictFailed(
                f"predict failed (metrics.json of the fit and test is written): {first_line(predict_error)}"
            ) from predict_error
        return result


NOT_RUN = {"fit": (), "validate": ("train/", "test/"), "test": ("train/", "val/"), "eval": ("train/",)}
NOT_RUN["predict"] = ("train/", "val/", "test/")
"""The metric prefixes a stage run alone does not make (nor ``TRAINING_KEYS``, outside a fit)."""
TRAINING_KEYS = ("samples_per_sec", "train_time_s", "first_step_unix_s")


def _missing(
    trainer: pl.Trainer, metrics: dict[str, float], stage: str, ran: set[str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Why each metric without a value has none (beyond ``report.metrics.MISSING``), and the keys the line omits."""
    tally = _callback(trainer, FitTally)
    logged = {"val/": "validate" in ran or (tally is not None and tally.validated_step is not None)}
    logged["test/"] = "test" in ran
    reasons: dict[str, str] = {}
    unshown = list(PER_RANK_KEYS)  # one entry per rank: in the file
    for key in (*METRIC_KEYS, *TRAINING_KEYS):
        prefix = key.split("/")[0] + "/"
        if prefix in NOT_RUN[stage] or (key in TRAINING_KEYS and stage != "fit"):
            reasons[key] = f"{'an' if stage[0] in 'aeiou' else 'a'} {stage} run: only {stage} ran"
            unshown.append(key)
        elif key in metrics and not math.isfinite(metrics[key]):
            reasons[key] = f"the model logged {metrics[key]} for it"
        elif key not in metrics and logged.get(prefix):
            reasons[key] = f"the model logs no {key}"
    return reasons, tuple(unshown)


def objective(cfg: DictConfig) -> str:
    """The metric a sweep optimises and the run returns: ``objective``, else ``val/loss``."""
    return str(cfg.get("objective") or "val/loss")


def _log_world(world: World, elastic: bool) -> None:
    """Log this start's world size under DDP (once per node); warn where an ``elastic`` node cannot join."""
    if world.family != "ddp" or launched_by_dpddp():
        return
    size, count, per = world.world_size, world.nodes, world.processes_per_node
    nodes = f"{count} node{'s' if count > 1 else ''}"
    log.info(f"world size {size}: {nodes} x {per} process{'es' if per > 1 else ''} ({world.world_size_source})")
    if elastic and agent_store_shared() and world.global_rank == 0:
        log.warning(
            "torchrun shares its rendezvous store with the workers, so a node that joins at a restart cannot start: "
            "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every node"
        )


PER_RANK_KEYS = ("compute_s_per_rank", "allreduce_wait_s_per_rank")


def _callback(trainer: pl.Trainer, cls: type[T]) -> T | None:
    """The trainer's first callback of class ``cls``, else ``None``."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)  # type: ignore[attr-defined]


def train_rank(job: RankJob) -> None:
    """A launched rank's share of a run: ``train`` on the job's resolved config (the ``RankJob.entry``)."""
    train(OmegaConf.create(job.config), job.output_dir, stage=job.stage)


def _run_stages(
    trainer: pl.Trainer, model: pl.LightningModule, datamodule: pl.LightningDataModule, plan: Plan, running: RunScope
) -> tuple[dict[str, float], set[str], Exception | None]:
    """The plan's stage run: its metrics, the stages run and a predict's error after a fit (the fit's metrics stand)."""
    cfg, stage = plan.cfg, plan.stage
    finished, predict_error, ran, metrics = False, None, {stage}, {}
    try:
        if stage == "fit":
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
            metrics.update(_floats(trainer.callback_metrics))
            metrics.update(_final_weights(trainer))
            if is_overridden("test_step", model):  # a user's model may have none: test/* are then null
                trainer.test(model, datamodule=datamodule, verbose=False)
                ran.add("test")
        elif stage in ("validate", "test", "eval"):  # eval: validate, then test (eval.py)
            for name in ("validate", "test") if stage == "eval" else (stage,):
                getattr(trainer, name)(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, verbose=False)
                metrics.update(_floats(trainer.callback_metrics))  # each stage's: the next one resets them
                ran.add(name)
        metrics.update(_floats(trainer.callback_metrics))
        if cfg.predict or stage == "predict":
            ckpt = cfg.ckpt_path if stage in ("predict", "eval") else None
            try:
                trainer.predict(model, datamodule=datamodule, return_predictions=False, ckpt_path=ckpt)
            except Exception as err:
                if stage == "predict" or isinstance(err, (ConfigError, Preempted)) or _named(trainer, err) is not err:
                    raise
                predict_error = err
        running.finish()
        finished = predict_error is None
        return metrics, ran, predict_error
    except Exception as err:
        named = loader_failed(err, trainer.global_rank) or _named(trainer, err)  # a stuck or dead loader worker
        if named is not err:
            raise named from err
        raise
    finally:
        if trainer.is_global_zero:
            close_trackers(trainer)
        # Stop watching this job's ranks before the next job of a sweep starts; a failed job's are killed.
        if isinstance(trainer.strategy, DDPStrategy) and trainer.strategy.supervisor is not None:
            trainer.strategy.supervisor.join(timeout_s=60.0 if finished else 5.0)
            if finished and trainer.strategy.supervisor.stopped():
                raise running.preempted()  # a SIGTERM reached a launched rank after the last agreement


def _named(trainer: pl.Trainer, err: Exception) -> Exception:
    """``err``, or a ``RankFailed`` naming the launched ranks that died (a refusal or a stop is its own answer)."""
    supervisor = trainer.strategy.supervisor if isinstance(trainer.strategy, DDPStrategy) else None
    own = (ConfigError, Preempted, ReplicasDiverged)  # every rank's own answer
    lost = [] if isinstance(err, own) or supervisor is None else supervisor.failed_ranks(2.0)
    return RankFailed(f"{'; '.join(lost)}; ending the run (rank 0: {first_line(err)})") if lost else err


def _final_weights(trainer: pl.Trainer) -> dict[str, float]:
    """Make ``last.ckpt`` and the validation metrics the final weights' (a mid-epoch stop, a swapped-in average)."""
    if trainer.fast_dev_run:  # type: ignore[attr-defined]  # no checkpoint, no more validation (Lightning)
        return {}
    averaged = save_final_checkpoint(trainer)  # other weights than last.ckpt's at its step: an average swapped in
    if stop := _callback(trainer, StepBoundaryStop):
        stop.stop_after_fit(trainer)  # a SIGTERM at the fit's end: stop with the final checkpoint
    tally, model = _callback(trainer, FitTally), trainer.lightning_module
    validated = tally is not None and tally.validated_step == trainer.global_step and not averaged
    if validated or trainer.limit_val_batches == 0 or not is_overridden("validation_step", model):
        return {}
    trainer.validate(model, datamodule=trainer.datamodule, verbose=False)  # type: ignore[attr-defined]
    return _floats(trainer.callback_metrics)


def _floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: v.item() for k, v in metrics.items()}


@contextmanager
def isolated_job() -> Iterator[None]:
    """Leave nothing of a job for the next one in this process: ``os.environ``, the thread count, the process group."""
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
