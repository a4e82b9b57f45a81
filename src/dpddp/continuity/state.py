"""The resumable state: dpddp's checkpoint entry, every edit of Lightning's loop counters, skipped plateau steps."""

from __future__ import annotations

import copy
import logging
import random
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from typing_extensions import override

from dpddp._compat import (
    batches_counted_as_steps,
    epoch_cut,
    epoch_finished_in,
    keep_unfinished_epoch,
    restart_train_iterator,
    step_count_either_way,
    uncount_last_batch,
)
from dpddp.continuity.io import AtomicCheckpointIO, other_steps_problem, read_checkpoint
from dpddp.continuity.replicas import ReplicaGuard
from dpddp.diagnostics.whereabouts import entering
from dpddp.errors import ConfigError, first_line
from dpddp.report.epochs import EpochRecord, EpochTable
from dpddp.report.throughput import ThroughputCounts

log = logging.getLogger(__name__)

KEY = "dpddp"  # the checkpoint entry this module owns


@runtime_checkable
class TrainLossSums(Protocol):
    """A module whose epoch train loss survives a mid-epoch checkpoint."""

    def train_loss_sums(self) -> torch.Tensor:
        """``[2]`` float64: this rank's loss sum and sample count this epoch."""

    def carry_train_loss(self, total: float, samples: int) -> None:
        """Add a restored ``(sum, samples)`` (on global rank 0 only)."""


def rank_seed(seed: int, global_rank: int) -> int:
    """The seed of rank ``global_rank``'s random stream: ``seed`` on rank 0, a distinct one on every other."""
    return seed if global_rank == 0 else int(np.random.SeedSequence([seed, global_rank]).generate_state(1)[0])


def random_state() -> dict[str, Any]:
    """This process's global random state (torch, CUDA, numpy, Python), loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, python, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss],
        "python": [version, list(python), python_gauss],
    }


def set_random_state(state: dict[str, Any]) -> None:
    """Restore a ``random_state()``."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, python, python_gauss = state["python"]
    random.setstate((version, tuple(python), python_gauss))


def _due(trainer: pl.Trainer, epoch: int) -> list[tuple[int, Any]]:
    """``(index, config)`` of the epoch-interval plateau schedulers Lightning steps at the end of ``epoch``."""
    configs = trainer.lr_scheduler_configs if trainer.lightning_module.automatic_optimization else []
    plateaus = [(i, c) for i, c in enumerate(configs) if c.reduce_on_plateau and c.interval == "epoch"]
    return [(i, c) for i, c in plateaus if (epoch + 1) % c.frequency == 0]


LIMIT_MARK = "so it cannot equal a straight run to this limit"  # in each limit_line: dpddp.check --stops finds it
LOOK_AHEAD = 3


def _stepped(scheduler: Any, build: dict[str, Any] | None = None, steps: int = 0) -> list[float | str]:
    """The first group's rate now and at the next ``LOOK_AHEAD`` steps (of ``build`` after ``steps``), or an error."""
    groups = scheduler.optimizer.param_groups
    saved = copy.deepcopy(scheduler.state_dict()), [{k: v for k, v in g.items() if k != "params"} for g in groups]
    found: list[float | str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step() before optimizer.step()
            if build is not None:
                scheduler.load_state_dict(copy.deepcopy(build))
                for group, lr in zip(groups, build.get("_last_lr") or [], strict=False):
                    group["lr"] = lr
                for _ in range(steps):
                    scheduler.step()
            found.append(float(groups[0]["lr"]))
            for _ in range(LOOK_AHEAD):
                scheduler.step()
                found.append(float(groups[0]["lr"]))
    except Exception as err:  # what the continued run's next step will raise
        return [*found, first_line(err)]
    finally:
        scheduler.load_state_dict(saved[0])
        for group, kept in zip(groups, saved[1], strict=True):
            group.update(kept)
    return found


def _shown(lrs: list[float | str], raised: bool = True) -> str:
    """The rates; with ``raised``, what a step raised."""
    numbers = ", ".join(f"{v:.3g}" for v in lrs if isinstance(v, float))
    error = next((v for v in lrs if isinstance(v, str)), None)
    return numbers + (f", then its step raises {error}" if error and raised else "")


def limit_line(scheduler: Any, plateau: bool, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The warning for a restored ``scheduler`` built (``old``) or stepping unlike a straight run's (``new``)."""
    name, apart = type(scheduler).__name__, built_apart(old, new)
    at = int(getattr(scheduler, "last_epoch", 0))
    plateau = plateau or getattr(scheduler, "optimizer", None) is None  # not stepped here: by its builds only
    ahead = [] if plateau else _stepped(scheduler)
    straight = [] if plateau else _stepped(scheduler, new, at)
    if apart is None and ahead == straight:
        return None
    if "lr_lambdas" in new:  # LambdaLR, MultiplicativeLR: the checkpoint holds their step, not their lambdas
        why = (
            f"{name}'s lambda is code, not state: the checkpoint restores its step ({at}) and this run's lambda, "
            "built for this run's limit, takes over from there, after steps the first run's lambda took"
        )
    elif apart is not None:
        builds = f"this run builds {apart[1]}: the continued run follows the first schedule"
        why = f"{name} was built with {apart[0]} for the limit the checkpoint's run had, and {builds}"
    else:
        why = f"{name} continues another schedule than a straight run to this limit takes"
    measured = f" (its learning rate from step {at}: {_shown(ahead)}; a straight run's: {_shown(straight, False)})"
    fix = "keep the first run's limit, or use a schedule that does not depend on it"
    return f"{why}, {LIMIT_MARK}{measured if ahead else ''}; {fix}"


def built_apart(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str] | None:
    """Where two builds of a scheduler differ (``("total_steps=50", "total_steps=102")``), or ``None``."""
    keys = [k for k in new if k in old and not _same(old[k], new[k])]
    shown = [k for k in keys if not k.startswith("_")] or keys
    if not shown:
        return None
    return ", ".join(f"{k}={old[k]}" for k in shown), ", ".join(f"{k}={new[k]}" for k in shown)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b) or (a != a and b != b)  # nan equals nan here


class ResumableState(pl.Callback):
    """Saves and loads ``checkpoint["dpddp"]`` and edits its loop counters, on every rank (docs/design-notes.md)."""

    def __init__(
        self,
        throughput: ThroughputCounts,
        epochs: EpochRecord,
        seed: int = 0,
        steps_per_execution: int = 1,
        uncounted: Callable[[], bool] = lambda: False,
        launch: str | None = None,
        guard: ReplicaGuard | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.guard = guard  # checks the ranks' replicas before every checkpoint
        self.batch_size = batch_size  # the global batch, where the config gives it (a mid-epoch continue's)
        self.throughput, self.epochs, self.seed, self.launch = throughput, epochs, seed, launch
        self.steps_per_execution, self.uncounted = steps_per_execution, uncounted
        self._random: dict[str, Any] | None = None  # this rank's restored state, until set
        self._mid_epoch = False
        self._iterate = False  # at the next epoch's start: make its loader iterator from the restored state
        self._should_stop = False  # restored: a callback had latched trainer.should_stop
        self._stopped_by: list[str] = []  # the state keys of the EarlyStopping callbacks that had stopped the fit
        self._cut: tuple[bool, dict[str, Any]] | None = None  # a cut epoch's flag and EarlyStoppings before its end
        self._schedules: list[dict[str, Any]] = []  # the schedulers' states as the run's first fit built them
        self._restored_schedules: list[dict[str, Any]] | None = None
        self._in_loop = False  # between on_train_start and on_train_end: the epoch-end updates are still due
        self._plateau: tuple[int, dict[int, float]] | None = None  # restored epoch, values saved for its steps

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            pl.seed_everything(rank_seed(self.seed, trainer.global_rank), workers=True, verbose=False)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        fitting = trainer.state.fn == "fit"
        if fitting and self.guard is not None:
            self.guard.check(trainer)  # before anything is written: a divergent replica's checkpoint never is
        self.epochs.flush(trainer)
        if fitting:
            keep_unfinished_epoch(trainer, checkpoint)
            if self.uncounted():
                uncount_last_batch(checkpoint)
        finished = not fitting or epoch_finished_in(trainer, checkpoint)
        comm = getattr(trainer.strategy, "comm_state_dict", lambda: None)()  # PowerSGD's, on every rank
        due = _due(trainer, trainer.current_epoch) if fitting and finished and self._in_loop else []
        metrics = trainer.callback_metrics  # the plateau steps still due at this epoch's end, and their values
        checkpoint[KEY] = {
            "throughput": asdict(self.throughput),
            "epochs": asdict(self.epochs.snapshot()),
            "train_loss": None if finished else self._train_loss(trainer, pl_module),
            "random": self._gather(trainer, random_state()),
            "mid_epoch": not finished,
            "plateau": {i: float(metrics[c.monitor]) for i, c in due if c.monitor in metrics},
            "should_stop": self._latched_stop(trainer) if self._cut is None or finished else self._cut[0],
            "stopped_by": [cb.state_key for cb in trainer.early_stopping_callbacks if _stopped(cb)],
            "schedules": self._schedules,
            "steps_per_execution": self.steps_per_execution,
            "launch": self.launch,
            "batch_size": self.batch_size,
            "comm_state": None if comm is None else self._gather(trainer, comm),
        }
        if self._cut is not None and not finished and "callbacks" in checkpoint:
            checkpoint["callbacks"].update(copy.deepcopy(self._cut[1]))

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        entry = checkpoint.get(KEY) or {}
        fitting = trainer.state.fn == "fit" and "loops" in checkpoint
        if fitting and (problem := other_steps_problem(checkpoint, self.steps_per_execution)):
            raise ConfigError(f"the checkpoint {problem}")
        if fitting and self.steps_per_execution == 1 and entry.get("steps_per_execution", 1) != 1:
            batches_counted_as_steps(checkpoint)  # an epoch's end: its executions counted as global batches
        for name, value in entry.get("throughput", {}).items():
            setattr(self.throughput, name, value)
        self.epochs.table = EpochTable(**entry["epochs"]) if "epochs" in entry else EpochTable()
        sums = entry.get("train_loss")
        if sums and trainer.global_rank == 0 and isinstance(pl_module, TrainLossSums):
            pl_module.carry_train_loss(float(sums[0]), int(sums[1]))
        states = entry.get("random") or []
        self._random = states[trainer.global_rank] if len(states) == trainer.world_size else None
        if states and self._random is None and trainer.global_rank == 0:
            had = f"the checkpoint holds the random states of {len(states)} processes and this run has"
            log.info(f"{had} {trainer.world_size}: the global random stream starts from this run's seeds")
        saved = entry.get("comm_state")  # this rank's PowerSGD state; none, or another world size's: left fresh
        if getattr(trainer.strategy, "comm_state", None) is not None and trainer.state.fn == "fit":
            if saved is not None and len(saved) == trainer.world_size:
                trainer.strategy.load_comm_state_dict(saved[trainer.global_rank])  # type: ignore[attr-defined]
            elif trainer.global_rank == 0:
                had = f"the states of {len(saved)} processes" if saved else "no PowerSGD state"
                log.info(f"the checkpoint holds {had}: PowerSGD starts afresh (plain all-reduce first)")
        self._mid_epoch = bool(entry.get("mid_epoch"))
        self._should_stop = bool(entry.get("should_stop"))
        self._stopped_by = list(entry.get("stopped_by") or [])
        if fitting:
            step_count_either_way(checkpoint)  # before Lightning restores the loops: global_step goes on either way
            self._plateau = int(checkpoint.get("epoch", 0)), dict(entry.get("plateau") or {})
            self._restored_schedules = entry.get("schedules")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedules = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]  # as built

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_loop = True
        if self._random is not None and not self._mid_epoch:
            set_random_state(self._random)
            self._random, self._iterate = None, True  # the straight run made the next epoch's from this state
        present = {cb.state_key for cb in trainer.callbacks}  # type: ignore[attr-defined]
        gone = self._stopped_by and not present & set(self._stopped_by)
        if self._should_stop and gone and trainer.global_rank == 0:
            by = f"the checkpoint's fit was stopped by {', '.join(self._stopped_by)}"
            log.warning(f"{by}, which this run does not have: training goes on to this run's limits")
        if self._should_stop and not gone:  # EarlyStopping before min_epochs, or a run it ended: the straight run's
            trainer.should_stop = True
        restored, self._restored_schedules = self._restored_schedules, None
        if restored is not None:  # a schedule built for another limit: said once
            found = zip(trainer.lr_scheduler_configs, restored, self._schedules, strict=False)
            for c, old, new in found if trainer.global_rank == 0 else []:
                if line := limit_line(c.scheduler, c.reduce_on_plateau, old, new):
                    log.warning(line)
            self._schedules = restored

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cut = None
        if self._iterate:
            self._iterate = False
            restart_train_iterator(trainer)
        self._take_plateau_steps(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A cut epoch's end: no EarlyStopping check, and the checkpoint keeps their states of before (design-notes).
        if epoch_cut(trainer) or self.uncounted():  # a limit, or max_steps inside the epoch's last execution
            states = {cb.state_key: copy.deepcopy(cb.state_dict()) for cb in trainer.early_stopping_callbacks}
            self._cut = self._latched_stop(trainer), states
            for cb in trainer.early_stopping_callbacks:
                cb.__dict__["on_train_epoch_end"] = lambda *args: None  # no check, this epoch's end only: _check_again

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_again(trainer)
        self._take_plateau_steps(trainer)
        self._in_loop = False

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._check_again(trainer)

    @staticmethod
    def _check_again(trainer: pl.Trainer) -> None:
        """The EarlyStoppings a cut epoch's end skipped check again."""
        for cb in trainer.early_stopping_callbacks:
            cb.__dict__.pop("on_train_epoch_end", None)

    def _take_plateau_steps(self, trainer: pl.Trainer) -> None:
        """Once the restored epoch has ended: the plateau steps Lightning skipped there (saved values, else now's)."""
        if self._plateau is None or trainer.current_epoch <= self._plateau[0]:
            return
        (epoch, saved), self._plateau = self._plateau, None
        for i, config in _due(trainer, epoch):
            value = saved.get(i, trainer.callback_metrics.get(config.monitor))
            if value is not None:
                trainer.lightning_module.lr_scheduler_step(config.scheduler, value)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._random is not None:  # after a mid-epoch checkpoint: where the straight run's next batch began
            set_random_state(self._random)
            self._random = None

    @staticmethod
    def _latched_stop(trainer: pl.Trainer) -> bool:
        """``trainer.should_stop``, less a ``Timer``'s (a limit a continued run may raise)."""
        remaining = [cb.time_remaining() for cb in trainer.callbacks if isinstance(cb, Timer)]  # type: ignore[attr-defined]
        if any(left is not None and left <= 0 for left in remaining):
            return any(_stopped(cb) for cb in trainer.early_stopping_callbacks)
        return bool(trainer.should_stop)

    @staticmethod
    def _train_loss(trainer: pl.Trainer, module: pl.LightningModule) -> list[float] | None:
        if not isinstance(module, TrainLossSums):
            return None
        total = trainer.strategy.reduce(module.train_loss_sums().to(module.device), reduce_op="sum")
        return [float(total[0]), float(total[1])]

    @staticmethod
    def _gather(trainer: pl.Trainer, state: dict[str, Any]) -> list[dict[str, Any]]:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [state]
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        with entering("the training state's gather"):
            torch.distributed.all_gather_object(gathered, state)
        return gathered


def save_final_checkpoint(trainer: pl.Trainer) -> bool:
    """Write ``last.ckpt`` (every rank) if it holds another step or other weights; returns whether weights differed."""
    io = trainer.strategy.checkpoint_io
    last = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.filename == "last"]
    if not (last and last[0].dirpath and isinstance(io, AtomicCheckpointIO)):
        return False
    io.wait()  # a background write of last.ckpt (a step interval's) is done, and counted in saved_steps
    path = Path(last[0].dirpath) / "last.ckpt"
    other_step = io.saved_steps.get("last.ckpt") != trainer.global_step  # rank 0 wrote it
    other = other_step or (trainer.is_global_zero and _other_weights(trainer.lightning_module, path))
    other_weights = bool(trainer.strategy.broadcast(not other_step and other))
    if trainer.strategy.broadcast(other):
        trainer.save_checkpoint(path, weights_only=False)  # explicit: no log line
    return other_weights


def _other_weights(module: pl.LightningModule, path: Path) -> bool:
    """Whether the ``state_dict`` saved at ``path`` differs from ``module``'s (a missing file: no)."""
    if not path.is_file():
        return False
    saved, current = read_checkpoint(path)["state_dict"], module.state_dict()
    return saved.keys() != current.keys() or any(not torch.equal(saved[k], v.cpu()) for k, v in current.items())


def _stopped(callback: pl.Callback) -> bool:
    """Whether an ``EarlyStopping`` callback has stopped its fit."""
    return getattr(callback, "stopping_reason", EarlyStoppingReason.NOT_STOPPED) is not EarlyStoppingReason.NOT_STOPPED
