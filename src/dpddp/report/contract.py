"""The metric contract a model meets for dpddp's promises (docs/your-model-and-data.md), and the
warning that names what is lost when a model breaks it."""

from __future__ import annotations

import difflib
import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from dpddp._compat import float_batch_counts, logged_metric_kinds, logged_tensor_states, restore_logged_tensors
from dpddp.errors import ConfigError
from dpddp.report.tally import FitTally

__all__ = ["REQUIRED", "LoggedTensors", "MetricContract"]

log = logging.getLogger(__name__)

REQUIRED = {"fit": ("train/loss", "val/loss", "val/acc"), "test": ("test/loss", "test/acc")}
"""The metric names a model logs, per stage."""


class MetricContract(pl.Callback):
    """Warns, once per name, when the model breaks the metric contract: a name of ``REQUIRED`` not logged
    (``metrics.json`` has ``null``), or, under more than one process, a name it reads (``REQUIRED``, a monitor)
    logged as a plain tensor instead of a torchmetrics ``Metric`` (what the value then is: ``_check_exact``).
    A monitor the model does not log is refused at the end of the first validation (``_check_monitors``)."""

    def __init__(self, tally: FitTally | None = None) -> None:
        self.warned: set[str] = set()
        self.tally = tally  # the run's, found at setup when not given
        self.settings: dict[int, str] = {}  # id(callback) -> the config key it was built from (callbacks.<name>)
        self.monitors_checked = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.tally is None:
            found = [cb for cb in trainer.callbacks if isinstance(cb, FitTally)]  # type: ignore[attr-defined]
            self.tally = found[0] if found else FitTally()
            if not found:  # a plain Lightning Trainer: count for ourselves, before this callback's hooks
                trainer.callbacks.insert(0, self.tally)  # type: ignore[attr-defined]

    def _warn(self, name: str, what: str) -> None:
        if name not in self.warned:
            self.warned.add(name)
            rank_zero_warn(f"metric contract: {what}")

    def _check_exact(self, trainer: pl.Trainer) -> None:
        """Under more than one process, a name the contract reads (``REQUIRED``, a callback's ``monitor``) that the
        running loop logs as a plain tensor: one warning saying what the value is."""
        if trainer.world_size < 2:
            return
        read = {n for names in REQUIRED.values() for n in names}
        read |= {cb.monitor for cb in trainer.callbacks if isinstance(getattr(cb, "monitor", None), str)}  # type: ignore[attr-defined]
        for name, (is_metric, synced) in logged_metric_kinds(trainer).items():
            if name not in read or is_metric:
                continue
            if synced:  # Lightning's sync_dist: sum over ranks of value x inferred batch size, over the samples
                what = (
                    "each step's value weighted by its chunk's samples over every rank (sync_dist): exact for a mean "
                    "over the chunk's samples (a loss, an accuracy), not for a metric that is not one (AUROC, F1)"
                )
            else:
                what = "rank 0's steps alone (no sync_dist): the other ranks' samples are not in it"
            self._warn(
                name,
                f"{name} is logged as a tensor with {trainer.world_size} processes, so it is {what}: log a "
                "torchmetrics Metric (synced sums and counts) to count every sample once",
            )

    def _check_names(self, trainer: pl.Trainer, stage: str) -> None:
        missing = [n for n in REQUIRED[stage] if n not in trainer.callback_metrics]
        validated = self.tally is not None and self.tally.validated_step is not None
        if stage == "fit" and not (trainer.limit_val_batches and validated):  # (the final weights are
            missing = [n for n in missing if not n.startswith("val/")]  # validated after a fit that ran none)
        for name in missing:
            self._warn(name, f"the model logs no {name}: metrics.json has null for it and nothing can monitor it")

    def _check_monitors(self, trainer: pl.Trainer) -> None:
        """At the end of the first validation (before the checkpoints', which Lightning calls last): a callback's
        ``monitor`` or a scheduler's that the model does not log is one ``ConfigError`` line naming the setting
        and what the model logs (Lightning would raise a traceback from the checkpoint instead)."""
        self.monitors_checked = True
        logged = sorted(trainer.callback_metrics)
        monitors = [
            (self.settings.get(id(cb), type(cb).__name__) + ".monitor", cb.monitor)
            for cb in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(getattr(cb, "monitor", None), str) and getattr(cb, "strict", True) is not False
        ]
        monitors += [
            (f"the model's {type(config.scheduler).__name__} monitor", config.monitor)
            for config in trainer.lr_scheduler_configs
            if config.monitor
        ]
        for setting, name in monitors:
            if name not in logged:
                close = difflib.get_close_matches(name, logged, n=1, cutoff=0.5)
                fix = "return one of those from configure_optimizers"
                if setting.startswith("callbacks."):
                    fix = f"set {setting}={close[0] if close else '<one of those>'}"
                raise ConfigError(
                    f"{setting}={name}: the model logs no {name} (it logs {', '.join(logged) or 'nothing'}): "
                    f"{fix}, or log {name}"
                )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            if not self.monitors_checked:
                self._check_monitors(trainer)
            self._check_exact(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_exact(trainer)
        self._check_names(trainer, "test")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_exact(trainer)  # what training logged (train/loss), in its steps and its epoch-end hooks
        if (
            trainer.current_epoch > 0 and self.tally is not None and self.tally.stepped
        ):  # at least one whole epoch, and a step in this fit (a run
            self._check_names(trainer, "fit")  # that EarlyStopping ended, continued, logs nothing)


def _rows(batch: Any) -> int | None:
    """The samples in ``batch``: the length of its first tensor (as Lightning infers a batch size)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return next((n for n in map(_rows, items) if n is not None), None)


class LoggedTensors(pl.Callback):
    """Under more than one process, a value the model logs as a plain tensor with ``sync_dist`` is the mean over
    every sample once, as Lightning means it (each step's value weighted by its chunk's samples, summed over the
    ranks): an evaluation step on an empty chunk (a split's last batch with fewer samples than processes) adds
    nothing (its mean over no samples is nan, which Lightning would weigh by 0 and still add: nan * 0 = nan), the
    states logged before it are put back after it (``dpddp._compat.restore_logged_tensors``); and the sample
    counts are summed over the ranks as floats (``dpddp._compat.float_batch_counts``), not floored."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    def _start(self, trainer: pl.Trainer, batch: Any) -> None:
        self.saved = logged_tensor_states(trainer) if _rows(batch) == 0 else None

    def _end(self, trainer: pl.Trainer) -> None:
        if self.saved is not None:
            restore_logged_tensors(trainer, self.saved)
            self.saved = None
        float_batch_counts(trainer)  # (Lightning computes the epoch's values right after the last batch)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any):
        self._start(trainer, batch)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._end(trainer)

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any):
        self._start(trainer, batch)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._end(trainer)
