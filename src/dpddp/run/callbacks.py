"""Lightning callbacks of every run: training throughput, the per-epoch record (``metrics.csv``, the epoch line,
training time over resumed segments), the progress bar, predictions to CSV, and stopping on SIGTERM."""

from __future__ import annotations

import csv
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from dpddp._compat import disable_sigterm_broadcast, keep_unfinished_epoch, restore_sigterm_broadcast
from dpddp.errors import Preempted
from dpddp.run import sweep_stop

__all__ = [
    "BAR_INTERVAL_S",
    "EPOCH_COLUMNS",
    "EpochRecord",
    "GlobalBatches",
    "LastValidation",
    "PredictionWriter",
    "Preemption",
    "RichBar",
    "TQDMBar",
    "Throughput",
]

log = logging.getLogger(__name__)

EPOCH_COLUMNS: tuple[str, ...] = ("stage", "epoch", "step", "train/loss", "val/loss", "val/acc", "test/loss")
EPOCH_COLUMNS += ("test/acc", "epoch_s", "samples_per_sec")
"""The columns of ``metrics.csv``, fixed whatever was logged: one ``fit`` row per epoch, one ``test`` row."""


class GlobalBatches:
    """Global batches a Lightning training batch trained: one, or with ``steps_per_execution > 1`` the optimizer
    steps it took (``trainer.global_step`` before and after; an execution cut by ``max_steps`` counts less)."""

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.by_steps, self._step = steps_per_execution > 1, 0

    def start(self, trainer: pl.Trainer) -> None:
        """At ``on_train_batch_start``."""
        if self.by_steps:  # trainer.global_step: a chain of properties, read only when it counts
            self._step = trainer.global_step

    def done(self, trainer: pl.Trainer) -> int:
        """At ``on_train_batch_end``: global batches since ``start``."""
        return trainer.global_step - self._step if self.by_steps else 1


class Throughput(pl.Callback):
    """Steady-state training throughput in samples/s over all processes.

    Reported at the end of the fit in ``trainer.callback_metrics[Throughput.KEY]`` (a finished run continued, with
    nothing left to train, reports its earlier segments' figure: the counts travel in the checkpoint). Counts the
    intervals between consecutive ``on_train_batch_end`` calls within an epoch (so data loading and the step are
    in, while start-up, the first step of each epoch and validation are out), each worth one global batch
    (``datamodule.batch_size`` samples), or with ``steps_per_execution > 1`` one per optimizer step it took. With
    a single step per epoch it falls back to the step times alone. Cheap: one ``time.perf_counter()`` per step,
    no sync.
    """

    KEY = "perf/samples_per_sec"
    FIRST_STEP_KEY = "perf/first_step_unix_s"

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.count = GlobalBatches(steps_per_execution)
        self.samples = 0
        self.seconds = 0.0
        self.fallback = [0, 0.0]
        self.first_step_unix_s: float | None = None  # wall-clock time (time.time()) of the first step's end
        self._last: float | None = None
        self._batch_start = 0.0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batch_start = time.perf_counter()
        self.count.start(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self.first_step_unix_s is None:
            self.first_step_unix_s = time.time()
        batch = trainer.datamodule.batch_size * self.count.done(trainer)  # type: ignore[attr-defined]
        if self._last is not None:
            self.samples += batch
            self.seconds += now - self._last
        self.fallback[0] += batch
        self.fallback[1] += now - self._batch_start
        self._last = now

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Into callback_metrics: that is what ddp_spawn carries back from its rank-0 process to the caller. At the
        # fit's end, not training's: a finished run continued trains nothing (no on_train_end) and keeps its figure.
        trainer.callback_metrics[self.KEY] = torch.tensor(self.samples_per_sec, dtype=torch.float64)
        if self.first_step_unix_s is not None:
            trainer.callback_metrics[self.FIRST_STEP_KEY] = torch.tensor(self.first_step_unix_s, dtype=torch.float64)

    @property
    def samples_per_sec(self) -> float:
        """Samples per second (``nan`` before any step)."""
        samples, seconds = (self.samples, self.seconds) if self.samples else self.fallback
        return samples / seconds if seconds > 0 else float("nan")

    @override
    def state_dict(self) -> dict[str, Any]:
        """The counts so far, in the checkpoint: a resumed run's throughput covers every segment."""
        return {"samples": self.samples, "seconds": self.seconds, "fallback": list(self.fallback)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples, self.seconds = int(state_dict["samples"]), float(state_dict["seconds"])
        self.fallback = [int(state_dict["fallback"][0]), float(state_dict["fallback"][1])]


class EpochRecord(pl.Callback):
    """One record per finished training epoch, and the training time of the run over all its segments.

    Per epoch (on global rank 0): a ``fit`` row appended to ``<output_dir>/metrics.csv`` (``EPOCH_COLUMNS``:
    ``train/loss`` and, when validation ran that epoch, ``val/loss`` and ``val/acc``; ``epoch_s``: seconds from
    the epoch's start to its end, validation included; ``samples_per_sec``: training samples of the epoch, one
    global batch per step, over ``epoch_s``), and with ``lines=True`` one log line
    (``epoch 3/10: train/loss=0.2231 val/loss=0.1823 val/acc=0.9658 (0.21 s, 24,300 samples/s)``; epochs
    counted from 1 there, from 0 in the table). A test adds a ``test`` row stamped with the last trained epoch.

    The rows, the training seconds and the number of segments (fits that took a step: the first run and each
    resume) travel in the checkpoint (``on_save_checkpoint``), so a run resumed from any ``last.ckpt`` rewrites
    ``metrics.csv`` with the checkpoint's epochs and extends it: epochs ``0..N-1`` once each, one table.
    ``train_time_s`` counts each segment from ``on_train_start`` to its end, or to its last checkpoint when it
    was stopped. At ``on_fit_end`` both go into ``trainer.callback_metrics`` (``TIME_KEY``, ``SEGMENTS_KEY``),
    what ``ddp_spawn`` carries back to the caller; a finished run continued (nothing left to train) keeps them.

    Lightning calls callbacks' ``on_train_epoch_end`` before the module's, where the built-in model logs
    ``train/loss``: the row is completed at the next hook (the epoch-end checkpoint, the next epoch's start or
    the end of training).

    Args:
        output_dir: the run directory (``metrics.csv`` goes there).
        lines: log a line per epoch through ``logging`` (Hydra's console and ``train.log``).
    """

    TIME_KEY = "perf/train_time_s"
    SEGMENTS_KEY = "perf/segments"
    CHECKPOINT_KEY = "dpddp_epoch_record"

    def __init__(self, output_dir: str | Path, lines: bool = False, steps_per_execution: int = 1) -> None:
        self.count = GlobalBatches(steps_per_execution)
        self.path = Path(output_dir) / "metrics.csv"
        self.lines = lines
        self.rows: list[dict[str, Any]] = []  # fit rows, epochs 0.. of this run
        self.segments = 0
        self._earlier_s = 0.0  # training seconds up to the segment now running
        self._segment_start: float | None = None
        self._epoch_start = 0.0
        self._steps = 0
        self._validated = False
        self._pending: dict[str, Any] | None = None
        self._trained = False  # this fit took a training step (a finished run continued takes none)

    @property
    def train_time_s(self) -> float:
        """Training seconds over all segments, the running one included."""
        running = time.perf_counter() - self._segment_start if self._segment_start is not None else 0.0
        return self._earlier_s + running

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trained = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._segment_start = time.perf_counter()
        # a fit restarted mid-epoch gets no on_train_epoch_start for that epoch: time its rest from here
        self._epoch_start, self._steps = self._segment_start, 0
        self.rows = [row for row in self.rows if row["epoch"] < trainer.current_epoch]
        if trainer.is_global_zero:
            self._write(self.rows, "w")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)
        self._epoch_start, self._steps, self._validated = time.perf_counter(), 0, False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.count.start(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._steps += self.count.done(trainer)
        if not self._trained:  # a segment is a fit that trained (not one EarlyStopping had already ended)
            self._trained = True
            self.segments += 1

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validated = self._validated or not trainer.sanity_checking

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = time.perf_counter() - self._epoch_start
        samples = self._steps * getattr(trainer.datamodule, "batch_size", 0)  # type: ignore[attr-defined]
        self._pending = {
            "stage": "fit",
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
            "epoch_s": seconds,
            "samples_per_sec": samples / seconds if seconds > 0 else float("nan"),
            "validated": self._validated,
        }

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)
        self._earlier_s, self._segment_start = self.train_time_s if self._trained else self._earlier_s, None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # At the fit's end, not training's: a finished run continued trains nothing, and keeps its time and count,
        # and its table (the checkpoint's rows) in the directory it continues in.
        if not self._trained:
            if trainer.is_global_zero:
                self._write(self.rows, "w")
            last = self.rows[-1] if self.rows else {}
            if last.get("step") == trainer.global_step and "train/loss" in last:  # the row of the final weights
                trainer.callback_metrics.setdefault("train/loss", torch.tensor(last["train/loss"]))
        trainer.callback_metrics[self.TIME_KEY] = torch.tensor(self._earlier_s, dtype=torch.float64)
        trainer.callback_metrics[self.SEGMENTS_KEY] = torch.tensor(self.segments, dtype=torch.float64)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        row: dict[str, Any] = {k: float(metrics[k]) for k in ("test/loss", "test/acc") if k in metrics}
        epoch = self.rows[-1]["epoch"] if self.rows else ""
        self._write([{"stage": "test", "epoch": epoch, "step": trainer.global_step, **row}], "a")

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._flush(trainer)
        state = {"rows": [dict(r) for r in self.rows], "train_time_s": self.train_time_s, "segments": self.segments}
        checkpoint[self.CHECKPOINT_KEY] = state

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        state = checkpoint.get(self.CHECKPOINT_KEY) or {}
        self.rows = [dict(r) for r in state.get("rows", [])]
        self._earlier_s = float(state.get("train_time_s", 0.0))
        self.segments = int(state.get("segments", 0))

    def _flush(self, trainer: pl.Trainer) -> None:
        """Complete the pending row with the epoch's metrics; write it and log its line (rank 0)."""
        if self._pending is None:
            return
        row, self._pending = self._pending, None
        keys = ("train/loss", "val/loss", "val/acc") if row.pop("validated") else ("train/loss",)
        metrics = trainer.callback_metrics
        row.update({k: float(metrics[k]) for k in keys if k in metrics})
        self.rows.append(row)
        if trainer.is_global_zero:
            self._write([row], "a")
            if self.lines:
                log.info(self._line(row, trainer.max_epochs))

    @staticmethod
    def _line(row: dict[str, Any], max_epochs: int | None) -> str:
        total = f"/{max_epochs}" if max_epochs not in (None, -1) else ""
        values = " ".join(f"{k}={row[k]:.4f}" for k in ("train/loss", "val/loss", "val/acc") if k in row)
        speed = f"{row['epoch_s']:.2f} s, {row['samples_per_sec']:,.0f} samples/s"
        return f"epoch {row['epoch'] + 1}{total}: {values} ({speed})"

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        """Write ``rows`` (``mode="w"``: the whole table; ``"a"``: appended, with the header if the file is new)."""
        header = mode == "w" or not self.path.is_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=EPOCH_COLUMNS, restval="")
            if header:
                writer.writeheader()
            writer.writerows(rows)


def _bar_metrics(items: dict[str, Any]) -> dict[str, Any]:
    """The bar's items without ``v_num`` (the logger's version: a directory name, not a metric) and
    ``train/loss`` (logged in the model's ``on_train_epoch_end``, which Lightning calls after the bar's own, so
    the bar would show the previous epoch's value; the epoch line and ``metrics.csv`` have the right one)."""
    return {k: v for k, v in items.items() if k not in ("v_num", "train/loss")}


BAR_INTERVAL_S = 0.1
"""The bar shows at most 10 updates a second (Lightning's bars update at every batch, and a tiny training step
takes less time than an update: the rich bar cost ~30% of W3's steps on 2 cores, bench/), and always a loop's
last batch."""


class _ThrottledBar(ProgressBar):
    """A bar's per-batch updates at most every ``BAR_INTERVAL_S`` seconds per loop (train, validate, test,
    predict), and always at a loop's last batch, so the bar ends where Lightning's would."""

    def _due(self, loop: str, n: int, total: float) -> bool:
        now, shown = time.monotonic(), self.__dict__.setdefault("_shown_at", {})
        if n >= total or now - shown.get(loop, -math.inf) >= BAR_INTERVAL_S:
            shown[loop] = now
            return True
        return False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due("train", args[-1] + 1, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, *args)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        batch_idx = args[2]  # outputs, batch, batch_idx[, dataloader_idx]
        if self._due("validate", batch_idx + 1, self.total_val_batches_current_dataloader):
            super().on_validation_batch_end(trainer, pl_module, *args)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due("test", args[2] + 1, self.total_test_batches_current_dataloader):
            super().on_test_batch_end(trainer, pl_module, *args)

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due("predict", args[2] + 1, self.total_predict_batches_current_dataloader):
            super().on_predict_batch_end(trainer, pl_module, *args)


class RichBar(_ThrottledBar, RichProgressBar):
    """Lightning's rich progress bar, showing only current metrics (see ``_bar_metrics``), updated and redrawn at
    most 10 times a second (``BAR_INTERVAL_S``; Lightning's redraws 100 times a second in a thread of its own)."""

    def __init__(self) -> None:
        super().__init__(refresh_rate=round(1 / BAR_INTERVAL_S))

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _bar_metrics(super().get_metrics(trainer, pl_module))


class TQDMBar(_ThrottledBar, TQDMProgressBar):
    """Lightning's tqdm progress bar (when ``rich`` is not installed), showing only current metrics, updated at
    most 10 times a second (``BAR_INTERVAL_S``)."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _bar_metrics(super().get_metrics(trainer, pl_module))


class PredictionWriter(BasePredictionWriter):
    """Writes ``predictions.csv`` (columns ``index, target, pred, prob_0 .. prob_{C-1}``) for the predict split,
    gathered from all ranks (``torch.distributed.all_gather_object``) and sorted by dataset index, each sample
    once. Expects batches ``(x, y, index)`` and ``predict_step`` outputs of class probabilities ``[b, C]``.

    Args:
        output_dir: where to write; ``None`` = ``trainer.log_dir`` (or ``default_root_dir``).
    """

    def __init__(self, output_dir: str | Path | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.rows: list[torch.Tensor] = []

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        _, target, index = batch
        probs = prediction.detach().float().cpu()
        pred = probs.argmax(dim=1, keepdim=True).to(probs.dtype)
        self.rows.append(torch.cat([index[:, None].to(probs.dtype), target[:, None].to(probs.dtype), pred, probs], 1))

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = torch.cat(self.rows) if self.rows else torch.zeros(0, 3)
        self.rows = []
        parts = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
            parts = gathered
        out = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)  # log_dir: a broadcast, all ranks
        if not trainer.is_global_zero:
            return
        table = torch.cat([p for p in parts if len(p)])
        table = table[table[:, 0].argsort()]
        out.mkdir(parents=True, exist_ok=True)
        num_classes = table.shape[1] - 3
        with open(out / "predictions.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "target", "pred", *(f"prob_{c}" for c in range(num_classes))])
            for row in table.tolist():
                writer.writerow([int(row[0]), int(row[1]), int(row[2]), *(f"{p:.6g}" for p in row[3:])])


class Preemption(pl.Callback):
    """Stop on SIGTERM within about ``interval_s`` seconds, on every rank, with a checkpoint to resume from.

    A SIGTERM to any process (or all, as schedulers do) only sets a flag. Under DDP the ranks agree on it with
    one ``all_reduce(MAX)`` every ``n`` steps, where ``n`` (1 to 1000) is re-derived at each check from the
    slowest rank's step time so that checks come about every ``interval_s`` seconds: every rank computes the
    same ``n`` from the same reduced values, so the collectives stay in step. One process checks after every
    step (no collective). This replaces Lightning's own SIGTERM handling for the fit: its handler broadcasts
    from rank 0 inside the signal handler (a signal to another rank is lost, or leaves the collectives out of
    step), and its training loop broadcasts a flag before every step (a blocking gloo collective per step,
    ~0.9 ms on 2 CPU cores: issue 7), which ``on_train_start`` turns off since that flag can no longer be set.

    In a sweep that stops as one (``dpddp.run.sweep_stop``), a SIGTERM stops the sweep too, and the sweep's stop
    counts as a SIGTERM: looked for at the start of the fit and at each check (at most every 0.25 s).

    When the flag is set, all ranks write ``<dirpath>/last.ckpt`` through ``trainer.save_checkpoint`` (rank 0
    writes) and raise ``Preempted``. The checkpoint is taken at the end of the first batch after which an
    optimizer step was taken (with ``accumulate_grad_batches=k``, the end of the open window of ``k``
    batches): a point Lightning restores mid-epoch from, with no gradient outside the checkpoint; the
    global-batch sampler then skips the batches already trained, so the resumed run ends with the weights of
    an uninterrupted one.

    Args:
        dirpath: where ``last.ckpt`` goes.
        interval_s: seconds between checks under DDP (the longest a SIGTERM waits, plus one step).
    """

    def __init__(self, dirpath: str | Path, interval_s: float = 1.0) -> None:
        self.dirpath = Path(dirpath)
        self.interval_s = interval_s
        self.requested = False
        self._before_fit: Any = None  # the SIGTERM handler before the fit, put back after it
        self._replaced = False
        self._every, self._steps, self._since = 1, 0, 0.0
        self._sweep_checked = 0.0
        self._agreed = False  # the ranks agreed to stop: at the next optimizer-step boundary

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True
        if sweep_stop.active():
            sweep_stop.request()  # the other jobs of the sweep stop now, not after this one's checkpoint

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and threading.current_thread() is threading.main_thread():  # before Lightning's handler
            self._before_fit = signal.getsignal(signal.SIGTERM)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():  # after Lightning installed its handler
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._replaced = True
            # Lightning's per-step broadcast of its own SIGTERM flag: never set now (its handler is replaced).
            disable_sigterm_broadcast(trainer)
        self._every, self._steps, self._since = 1, 0, time.perf_counter()
        self._agreed = False
        self.requested = self.requested or sweep_stop.requested()  # stopped while this job was starting
        # A run that EarlyStopping ended stays ended when continued to a later limit, as a straight run does
        # (its state, stopped_epoch included, is restored from the checkpoint before this hook). Not after a stop
        # by a limit inside an epoch (restored mid-epoch): the validation Lightning ran there is not a straight
        # run's, and the straight run decides at the epoch's end.
        stopped = any(cb.stopped_epoch > 0 for cb in trainer.early_stopping_callbacks)
        if stopped and not trainer.fit_loop.restarting:
            trainer.should_stop = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The handler from before the fit, not Lightning's (its teardown put the same one back just before): one
        # left behind would only log a later SIGTERM, and a sweep's process would then outlive it.
        if self._replaced:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._before_fit is None else self._before_fit)
            self._replaced = False
        restore_sigterm_broadcast(trainer)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # A stop by a limit mid-epoch resumes like a stop by SIGTERM: inside the epoch (case 13).
        if trainer.state.fn == "fit":
            keep_unfinished_epoch(trainer, checkpoint)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._agreed:
            self._agreed = self._agree(trainer)
        # Stop where an optimizer step has just been taken: a gradient summed over part of an accumulation
        # window lives only in .grad, which no checkpoint holds (case 12). Every rank sees the same batch_idx.
        batch_idx = args[-1]
        window_closed = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if self._agreed and (window_closed or batch_idx + 1 >= trainer.num_training_batches):
            path = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)  # explicit: Lightning logs a line when it is unset
            raise Preempted(path, trainer.global_step)

    def _agree(self, trainer: pl.Trainer) -> bool:
        """Whether any rank got SIGTERM, agreed every ``n`` steps (see the class doc); ``False`` in between."""
        self._steps += 1
        if self._steps < self._every:
            return False
        if not self.requested and time.perf_counter() - self._sweep_checked >= 0.25:  # a stat, not every step
            self._sweep_checked = time.perf_counter()
            self.requested = sweep_stop.requested()
        requested = self.requested
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            now = time.perf_counter()
            flags = torch.tensor([float(requested), (now - self._since) / self._steps], dtype=torch.float64)
            flags = flags.to(trainer.strategy.root_device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            flag, step_s = flags.tolist()
            requested = bool(flag)
            self._every = int(min(max(self.interval_s / max(step_s, 1e-9), 1), 1000))
            self._since = now
        self._steps = 0
        return requested


class LastValidation(pl.Callback):
    """Remembers the global step (optimizer steps) of the last validation of a fit, so that the run can tell
    whether its final weights were validated (``step`` is ``None`` before any)."""

    def __init__(self) -> None:
        self.step: int | None = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step
