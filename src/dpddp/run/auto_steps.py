"""``steps_per_execution=auto``: the fit's K, resolved once before its training loader is built, from the
measured seconds of one optimizer step of the run's model, so that the loop's cost per iteration
(``LOOP_OVERHEAD_S``) is at most ``OVERHEAD_SHARE`` of an execution. See docs/performance.md (tiny steps).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from omegaconf import DictConfig

from dpddp._compat import agent_store
from dpddp.cluster import (
    env_rank,
    in_cluster_job,
    launched_by_dpddp,
    local_rank,
    master_address,
    torchrun_restart_count,
    writes_outputs,
)
from dpddp.continuity.io import checkpoint_steps_per_execution
from dpddp.continuity.stop import checkpoint_intervals
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.errors import first_line
from dpddp.parallel.bandwidth import step_seconds
from dpddp.parallel.rules import resolve_accelerator, world_size
from dpddp.run.config import execution_refusal
from dpddp.run.executions import TRANSFER_HOOKS, skipped_hook
from dpddp.run.keys import target_class

__all__ = ["LOOP_OVERHEAD_S", "MAX_AUTO_STEPS", "OVERHEAD_SHARE", "auto_steps", "resolve_steps", "seen_executions"]

log = logging.getLogger(__name__)

LOOP_OVERHEAD_S = 1.0e-3
"""Seconds one Lightning loop iteration costs beside its steps (bench/PROFILE.md: 1.06 ms on W2, 0.81 ms on W3,
from K=1 against K=16 on 2 CPU cores)."""
OVERHEAD_SHARE = 0.05
"""The largest share of an execution's time the loop's cost may take."""
MAX_AUTO_STEPS = 256
"""The largest K auto chooses. The rule itself keeps a probed execution under ``2 * LOOP_OVERHEAD_S /
OVERHEAD_SHARE`` (40 ms), what progress, checkpoints and a SIGTERM wait for at most; this bounds K where a step
is too short to time."""
PROBE_STEPS = 5
"""Timed steps of the probe (after one warm-up), when the first is shorter than an execution needs."""

_resolutions = itertools.count()  # the resolutions of this process, alike on every rank (the same jobs, in order)


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def auto_steps(step_s: float, steps_per_epoch: int) -> int:
    """The smallest power of two ``K`` with ``LOOP_OVERHEAD_S <= OVERHEAD_SHARE * K * step_s`` (``step_s``:
    seconds of one optimizer step), at most ``MAX_AUTO_STEPS`` and the largest power of two within
    ``steps_per_epoch``; 1 for a step that is not a positive finite time."""
    if not math.isfinite(step_s) or step_s <= 0:
        return 1
    need = LOOP_OVERHEAD_S / (OVERHEAD_SHARE * step_s)
    k = 1 if need <= 1 else 1 << math.ceil(math.log2(need))
    return min(k, MAX_AUTO_STEPS, _floor_power_of_two(steps_per_epoch))


BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")
"""A training loop iteration's hooks: with K above 1 they see executions, not global batches."""
UNSEEING_CALLBACKS = (EarlyStopping, ModelSummary)
"""Lightning's callbacks that see no training batch or step (epoch ends and the fit's start only)."""


def _dpddp_defined(cls: type, hook: str) -> bool:
    """Whether ``cls``'s ``hook`` is defined in dpddp's package (K-aware by construction)."""
    return str(getattr(getattr(cls, hook, None), "__module__", "")).split(".")[0] == "dpddp"


def _own_hook(obj: object, hook: str, parent: type) -> bool:
    """Whether ``obj`` (an instance or class) overrides ``parent``'s ``hook`` outside dpddp's package."""
    cls = obj if isinstance(obj, type) else type(obj)
    return is_overridden(hook, obj, parent) and not _dpddp_defined(cls, hook)


def _seen_by_callback(section: str, spec: Mapping) -> str | None:
    cls = target_class(section, spec)
    if cls.__module__.split(".")[0] == "dpddp" or issubclass(cls, UNSEEING_CALLBACKS):
        return None
    if issubclass(cls, ModelCheckpoint) and not _own_hook(cls, "on_train_batch_end", ModelCheckpoint):
        steps, interval = spec.get("every_n_train_steps"), spec.get("train_time_interval")
        if not steps and interval is None:
            return None
        name = "every_n_train_steps" if steps else "train_time_interval"
        return f"{section}.{name}={steps or interval}: its trigger would see executions"
    return f"{section} ({cls.__name__}) is not one of the callbacks known to see no training batch"


def seen_executions(cfg: Mapping, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> str | None:
    """What in ``cfg``'s run would see an execution where ``steps_per_execution=1`` shows it a global batch, as
    ``"<what>: <why>"``, or ``None``: a ``training_step`` outside dpddp's package (its per-step logs and returned
    outputs), the model's or data module's batch hooks, or a configured callback, unless it is one of dpddp's own
    classes, ``EarlyStopping``, a model summary or a ``ModelCheckpoint`` without a step or time trigger. ``auto``
    keeps K=1 for these (a K given explicitly takes them as the docs say)."""
    name = type(model).__name__
    if not _dpddp_defined(type(model), "training_step"):
        return f"{name}.training_step is the model's own: its per-step logs and outputs would see executions"
    for hook in (*BATCH_HOOKS, *TRANSFER_HOOKS):
        if _own_hook(model, hook, pl.LightningModule):
            return f"{name}.{hook} would see executions"
        if hook in TRANSFER_HOOKS and _own_hook(datamodule, hook, pl.LightningDataModule):
            return f"{type(datamodule).__name__}.{hook} would see executions"
    for key, spec in (cfg.get("callbacks") or {}).items():
        if spec is not None and (seen := _seen_by_callback(f"callbacks.{key}", spec)):
            return seen
    return None


def _largest_power_of_two_dividing(n: int) -> int:
    return n & -n


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
    """The median seconds of one optimizer step (this rank's ``share`` of a global batch gathered, then
    ``zero_grad``, ``training_step``, backward, ``step``) of a copy of ``model`` after a warm-up step (a warm-up of
    at least 20 ms: the one step after it), or a string saying why there is none. The run's model, random streams
    and weights are untouched; its data module is set up."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        try:
            datamodule.setup("fit")
        except Exception as err:  # a data module of the user's that needs its Trainer: not timed here
            return f"{type(datamodule).__name__}.setup needs its Trainer ({type(err).__name__})"
        twin = copy.deepcopy(model).to(device).train()
        try:
            optimizer = _single_optimizer(twin.configure_optimizers())
        except Exception as err:  # e.g. one that reads its Trainer: not timed here
            return f"{type(model).__name__}.configure_optimizers needs its Trainer ({type(err).__name__})"
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
        if first < LOOP_OVERHEAD_S / OVERHEAD_SHARE:
            return step_seconds(step, reps=PROBE_STEPS)
        start = time.perf_counter()  # a slow warm-up (one-time costs: the optimizer's state, allocations, a busy
        step()  # machine): one more step decides
        return time.perf_counter() - start


def _device(cfg: DictConfig) -> torch.device:
    """The device this rank trains on: the CPU, or its GPU (``LOCAL_RANK``'s) when the run's accelerator is one."""
    if resolve_accelerator(str(cfg.accelerator)) != "gpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank())


def _independent_ranks(cfg: DictConfig) -> bool:
    """Whether this process is one of a run's ranks that started apart (torchrun, SLURM, a node started by hand),
    rather than a run whose ranks this process starts (and hands the resolved K) or one process."""
    return world_size(cfg) > 1 and not launched_by_dpddp() and (in_cluster_job() or int(cfg.num_nodes) > 1)


def _agreed(cfg: DictConfig, measure: Callable[[], tuple[int, str]]) -> tuple[int, str]:
    """``measure()`` on global rank 0, the same ``(K, why)`` on every rank: rank 0's, through torchrun's agent
    store where the ranks started apart; ``(1, why)`` where they did and no store is shared."""
    if not _independent_ranks(cfg):
        return measure()
    address, port = master_address()
    timeout = timedelta(seconds=float((cfg.strategy or {}).get("timeout_s", 180)))
    store = agent_store(address, int(port), timeout) if address and port else None
    if store is None:
        return 1, "ranks started apart, with no shared store to agree on one measured K: give steps_per_execution=K"
    key = f"dpddp/steps_per_execution/{torchrun_restart_count()}/{next(_resolutions)}"
    if env_rank() == 0:
        k, why = measure()
        store.set(key, json.dumps([k, why]))
        return k, why
    k, why = json.loads(store.get(key))
    return int(k), str(why)


def resolve_steps(cfg: DictConfig, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> int:
    """The K of a fit with ``steps_per_execution=auto``, the same on every rank, logged once in one line
    (``steps_per_execution=auto: 8 (a step 0.16 ms: ...)``): 1 where a K above 1 is refused (``execution_refusal``,
    manual optimization, an optimizer setup ``StepsPerExecution`` cannot run); the checkpoint's K when the fit
    continues one (``ckpt_path``); else ``auto_steps`` of the probed step (a copy of ``model`` on this rank's
    share of a global batch). Raises nothing of its own."""
    k, why = _resolve(cfg, model, datamodule)
    if writes_outputs():
        log.info(f"steps_per_execution=auto: {k} ({why})")
    return k


def _resolve(cfg: DictConfig, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> tuple[int, str]:
    if refusal := execution_refusal(cfg):
        return 1, refusal
    if not model.automatic_optimization:
        return 1, f"{type(model).__name__} uses manual optimization"
    if hook := skipped_hook(model):
        return 1, f"{type(model).__name__}.{hook}: an execution's steps would not call it"
    if cfg.get("ckpt_path") is not None:
        return checkpoint_steps_per_execution(cfg.ckpt_path), "the checkpoint's"
    if seen := seen_executions(cfg, model, datamodule):
        return 1, f"{seen}; give steps_per_execution=K to take K anyway (docs/performance.md)"
    assert isinstance(datamodule, GlobalBatchDataModule)  # execution_refusal: global-batch data
    share, every = int(datamodule.batch_size) // world_size(cfg), checkpoint_intervals(cfg)[0]

    def measure() -> tuple[int, str]:
        device = _device(cfg)
        seconds = _probe(model, datamodule, share, device)
        if device.type == "cuda":  # the copy's memory, back to the run
            torch.cuda.empty_cache()
        if isinstance(seconds, str):
            return 1, seconds
        per_epoch = len(datamodule.splits["train"]) // int(datamodule.batch_size)  # type: ignore[arg-type]
        k, need = auto_steps(seconds, per_epoch), LOOP_OVERHEAD_S / (OVERHEAD_SHARE * seconds)
        if every and k > (most := _largest_power_of_two_dividing(every)):
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

    return _agreed(cfg, measure)
