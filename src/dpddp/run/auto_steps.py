"""``steps_per_execution=auto``: the fit's K from a measured optimizer step (docs/performance.md, tiny steps)."""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from importlib.metadata import entry_points
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_utilities.core.apply_func import apply_to_collection

from dpddp._compat import agent_store
from dpddp.cluster import in_cluster_job, launched_by_dpddp, master_address, torchrun_restart_count
from dpddp.continuity.io import checkpoint_intervals
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.errors import first_line
from dpddp.report.trackers import logger_specs
from dpddp.run.config import Plan, execution_refusal
from dpddp.run.draws_seen import streams_kept
from dpddp.run.executions import known
from dpddp.run.keys import target_class

log = logging.getLogger(__name__)

LOOP_OVERHEAD_S = 1.0e-3  # seconds one Lightning loop iteration costs beside its steps (bench/PROFILE.md)
OVERHEAD_SHARE = 0.05  # the largest share of an execution's time the loop's cost may take
MAX_AUTO_STEPS = 256  # the largest K auto chooses (a bound where a step is too short to time)
PROBE_STEPS = 5  # timed steps of the probe after its warm-up, when the warm-up is short
CALLBACKS_FACTORY = "lightning.pytorch.callbacks_factory"  # entry points Lightning adds to every Trainer


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def auto_steps(step_s: float, steps_per_epoch: int) -> int:
    """The least power of two ``K`` with ``LOOP_OVERHEAD_S <= OVERHEAD_SHARE * K * step_s``, capped; 1 for no time."""
    if not math.isfinite(step_s) or step_s <= 0:
        return 1
    need = LOOP_OVERHEAD_S / (OVERHEAD_SHARE * step_s)
    k = 1 if need <= 1 else 1 << math.ceil(math.log2(need))
    return min(k, MAX_AUTO_STEPS, _floor_power_of_two(steps_per_epoch))


def seen_executions(cfg: Mapping, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> str | None:
    """``"<what>: <why>"`` for the first object of ``cfg``'s run that could see an execution, or ``None``."""
    for what, obj in (("model", model), ("data", datamodule)):
        if not known(obj):
            return f"{what}._target_ ({type(obj).__name__}) is not one of dpddp's own classes: it could see executions"
    for key, spec in (cfg.get("callbacks") or {}).items():
        if spec is None:
            continue
        setting, cls = f"callbacks.{key}", target_class(f"callbacks.{key}", spec)
        if not known(cls):
            return f"{setting} ({cls.__name__}) is not one of dpddp's callbacks or Lightning's known by exact type"
        trigger = "every_n_train_steps" if spec.get("every_n_train_steps") else "train_time_interval"
        if cls is ModelCheckpoint and spec.get(trigger) is not None:
            return f"{setting}.{trigger}={spec[trigger]}: its trigger would see executions"
    for key, spec in logger_specs(cfg):
        if not known(cls := target_class(key, spec)):
            return f"{key} ({cls.__name__}) is not one of the loggers known by exact type"
    if (limit := (cfg.get("trainer") or {}).get("max_time")) is not None:
        return f"trainer.max_time={limit}: Lightning's Timer would see executions"
    if factory := entry_points(group=CALLBACKS_FACTORY):
        return f"{CALLBACKS_FACTORY} entry point {next(iter(factory)).name}: its callbacks could see executions"
    return None


def _single_optimizer(conf: Any) -> torch.optim.Optimizer | None:
    """The one optimizer of a ``configure_optimizers`` result with no LR scheduler, else ``None``."""
    if isinstance(conf, (list, tuple)) and len(conf) == 1:
        conf = conf[0]
    if isinstance(conf, Mapping) and set(conf) == {"optimizer"}:
        conf = conf["optimizer"]
    return conf if isinstance(conf, torch.optim.Optimizer) else None


def _probe(
    model: pl.LightningModule, datamodule: GlobalBatchDataModule, share: int, device: torch.device
) -> float | str:
    """The median seconds of a copy's optimizer step on ``share`` samples after a warm-up, or why there is none."""
    with streams_kept([device.index or 0] if device.type == "cuda" else ()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        try:  # a data module's setup or an optimizer that needs its Trainer, a model that cannot be copied
            datamodule.setup("fit")
            twin = copy.deepcopy(model).to(device).train()
            optimizer = _single_optimizer(twin.configure_optimizers())
        except Exception as err:  # not timed here; the run itself says what is wrong, where it would at K=1
            return f"the probe could not start ({type(err).__name__}: {first_line(err)})"
        if optimizer is None:
            return f"{type(model).__name__} has more than one optimizer or an LR scheduler"
        train, ids = datamodule.splits["train"], torch.arange(share)
        returned: list[Any] = []

        def step() -> None:
            batch = apply_to_collection(train[ids], torch.Tensor, lambda t: t.to(device))
            optimizer.zero_grad()
            out = twin.training_step(batch, 0)
            loss = out["loss"] if isinstance(out, Mapping) else out
            returned.append(loss is not None)
            if loss is not None:
                loss.backward()
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        start = time.perf_counter()
        try:
            step()  # the warm-up
        except Exception as err:  # the run itself says what is wrong, where it would have at K=1
            return f"a probe step of {type(model).__name__} failed ({type(err).__name__}: {first_line(err)})"
        first = time.perf_counter() - start
        if not all(returned):
            return f"{type(model).__name__}.training_step returned None (a skipped step)"
        times = []  # after a slow warm-up (one-time costs, a busy machine), one more step decides
        for _ in range(PROBE_STEPS if first < LOOP_OVERHEAD_S / OVERHEAD_SHARE else 1):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def _agreed(plan: Plan, measure: Callable[[], tuple[int, str]]) -> tuple[int, str]:
    """Rank 0's ``measure()`` on every rank (through torchrun's agent store where the ranks started apart)."""
    world = plan.world
    if world.world_size == 1 or launched_by_dpddp() or not (in_cluster_job() or world.nodes > 1):
        return measure()
    address, port = master_address()
    timeout = timedelta(seconds=float((plan.cfg.strategy or {}).get("timeout_s", 180)))
    store = agent_store(address, int(port), timeout) if address and port else None
    if store is None:
        return 1, "ranks started apart, with no shared store to agree on one measured K: give steps_per_execution=K"
    at = f"dpddp/steps_per_execution/{torchrun_restart_count()}"
    key = f"{at}/{store.add(f'{at}/rank{world.global_rank}', 1)}"  # this rank's count: alike on every rank
    if world.global_rank == 0:
        k, why = measure()
        store.set(key, json.dumps([k, why]))
        return k, why
    k, why = json.loads(store.get(key))
    return int(k), str(why)


def resolve_steps(plan: Plan, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> int:
    """The K of ``plan``'s ``steps_per_execution=auto`` fit, alike on every rank, logged with why."""
    if refusal := execution_refusal(plan.cfg):
        k, why = 1, refusal
    elif seen := seen_executions(plan.cfg, model, datamodule):
        k, why = 1, f"{seen}; give steps_per_execution=K to take K anyway (docs/performance.md)"
    elif plan.checkpoint is not None:
        k, why = plan.checkpoint.steps_per_execution, "the checkpoint's"
    else:
        k, why = _agreed(plan, lambda: _measure(plan, model, datamodule))
    if plan.world.writes_outputs:
        log.info(f"steps_per_execution=auto: {k} ({why})")
    return k


def _measure(plan: Plan, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> tuple[int, str]:
    """This rank's K from a probe of ``model``'s step on its share of a global batch, and why."""
    world, every = plan.world, checkpoint_intervals(plan.cfg)[0]
    assert isinstance(datamodule, GlobalBatchDataModule)  # execution_refusal: global-batch data
    gpu = world.accelerator == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda", world.local_rank) if gpu else torch.device("cpu")
    seconds = _probe(model, datamodule, int(datamodule.batch_size) // world.world_size, device)
    if device.type == "cuda":  # the copy's memory, back to the run
        torch.cuda.empty_cache()
    if isinstance(seconds, str):
        return 1, seconds
    per_epoch = len(datamodule.splits["train"]) // int(datamodule.batch_size)  # type: ignore[arg-type]
    k, need = auto_steps(seconds, per_epoch), LOOP_OVERHEAD_S / (OVERHEAD_SHARE * seconds)
    if every and k > (most := every & -every):  # the largest power of two dividing it
        return most, f"checkpoint.every_n_steps={every}: a K dividing it keeps each write at its step"
    why = (
        f"a step {seconds * 1e3:.3g} ms; the loop's {LOOP_OVERHEAD_S * 1e3:.3g} ms within {OVERHEAD_SHARE:.0%} "
        f"of an execution needs K >= {need:.2g}"
    )
    if k < need and k == _floor_power_of_two(per_epoch) < MAX_AUTO_STEPS:
        why += f"; at most {k}: {per_epoch} steps an epoch"
    elif k < need:
        why += f"; at most MAX_AUTO_STEPS={MAX_AUTO_STEPS}"
    return k, why
