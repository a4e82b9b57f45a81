"""Lightning callbacks of every run: training throughput, predictions to CSV, and stopping on SIGTERM."""

from __future__ import annotations

import csv
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from dpddp._compat import disable_sigterm_broadcast, restore_sigterm_broadcast
from dpddp.errors import Preempted

__all__ = ["Preemption", "PredictionWriter", "Throughput"]


class Throughput(pl.Callback):
    """Steady-state training throughput in samples/s over all processes.

    Reported at the end of training in ``trainer.callback_metrics[Throughput.KEY]``. Counts the intervals between
    consecutive ``on_train_batch_end`` calls within an epoch (so data loading and
    the step are in, while start-up, the first step of each epoch and validation are out), each worth one
    global batch (``datamodule.batch_size`` samples). With a single step per epoch it falls back to the step
    times alone. Cheap: one ``time.perf_counter()`` per step, no sync.
    """

    KEY = "perf/samples_per_sec"
    FIRST_STEP_KEY = "perf/first_step_unix_s"

    def __init__(self) -> None:
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

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self.first_step_unix_s is None:
            self.first_step_unix_s = time.time()
        batch = trainer.datamodule.batch_size  # type: ignore[attr-defined]
        if self._last is not None:
            self.samples += batch
            self.seconds += now - self._last
        self.fallback[0] += batch
        self.fallback[1] += now - self._batch_start
        self._last = now

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Into callback_metrics: that is what ddp_spawn carries back from its rank-0 process to the caller.
        trainer.callback_metrics[self.KEY] = torch.tensor(self.samples_per_sec, dtype=torch.float64)
        if self.first_step_unix_s is not None:
            trainer.callback_metrics[self.FIRST_STEP_KEY] = torch.tensor(self.first_step_unix_s, dtype=torch.float64)

    @property
    def samples_per_sec(self) -> float:
        """Samples per second (``nan`` before any step)."""
        samples, seconds = (self.samples, self.seconds) if self.samples else self.fallback
        return samples / seconds if seconds > 0 else float("nan")


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

    When the flag is set, all ranks write ``<dirpath>/last.ckpt`` through ``trainer.save_checkpoint`` (rank 0
    writes) and raise ``Preempted``. The checkpoint is taken at a step end, the point Lightning restores
    mid-epoch from; ``RandomTensorDataModule`` then skips the batches of that epoch already trained, so the
    resumed run ends with the weights of an uninterrupted one.

    Args:
        dirpath: where ``last.ckpt`` goes.
        interval_s: seconds between checks under DDP (the longest a SIGTERM waits, plus one step).
    """

    def __init__(self, dirpath: str | Path, interval_s: float = 1.0) -> None:
        self.dirpath = Path(dirpath)
        self.interval_s = interval_s
        self.requested = False
        self._previous: Any = None
        self._every, self._steps, self._since = 1, 0, 0.0

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():  # after Lightning installed its handler
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            # Lightning's per-step broadcast of its own SIGTERM flag: never set now (its handler is replaced).
            disable_sigterm_broadcast(trainer)
        self._every, self._steps, self._since = 1, 0, time.perf_counter()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        restore_sigterm_broadcast(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._steps += 1
        if self._steps < self._every:
            return
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
        if requested:
            path = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(path)
            raise Preempted(path, trainer.global_step)
