"""The metric contract a model meets for dpddp's promises (docs/your-model-and-data.md)."""

from __future__ import annotations

import difflib
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from dpddp._compat import float_batch_counts, logged_metric_kinds, logged_tensor_states, restore_logged_tensors
from dpddp.errors import ConfigError
from dpddp.report.tally import FitTally, rows

REQUIRED = {"fit": ("train/loss", "val/loss", "val/acc"), "test": ("test/loss", "test/acc")}


class MetricContract(pl.Callback):
    """Warns once per ``REQUIRED`` name not logged or read as a plain tensor; refuses a monitor not logged."""

    def __init__(self, tally: FitTally | None = None) -> None:
        self.warned: set[str] = set()
        self.tally = tally  # the run's, found at setup when not given (the assembly puts it first)
        self.settings: dict[int, str] = {}  # id(callback) -> the config key it was built from (callbacks.<name>)
        self.monitors_checked = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.tally is None:
            self.tally = next(cb for cb in trainer.callbacks if isinstance(cb, FitTally))  # type: ignore[attr-defined]

    def _warn(self, name: str, what: str) -> None:
        if name not in self.warned:
            self.warned.add(name)
            rank_zero_warn(f"metric contract: {what}")

    def _check_exact(self, trainer: pl.Trainer) -> None:
        """Under several processes, one warning per name read that the loop logs as a plain tensor."""
        if trainer.world_size < 2:
            return
        read = {n for names in REQUIRED.values() for n in names}
        read |= {cb.monitor for cb in trainer.callbacks if isinstance(getattr(cb, "monitor", None), str)}  # type: ignore[attr-defined]
        for name, (is_metric, synced) in logged_metric_kinds(trainer).items():
            if name not in read or is_metric:
                continue
            what = "rank 0's steps alone (no sync_dist): the other ranks' samples are not in it"
            if synced:  # Lightning's sync_dist: sum over ranks of value x inferred batch size, over the samples
                what = (
                    "each step's value weighted by its chunk's samples over every rank (sync_dist): exact for a mean "
                    "over the chunk's samples (a loss, an accuracy), not for a metric that is not one (AUROC, F1)"
                )
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
        """Raises ``ConfigError`` for a callback's or scheduler's ``monitor`` the model does not log."""
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
        # at least one whole epoch, and a step in this fit (a run EarlyStopping ended, continued, logs nothing)
        if trainer.current_epoch > 0 and self.tally is not None and self.tally.stepped:
            self._check_names(trainer, "fit")


class LoggedTensors(pl.Callback):
    """A tensor logged with ``sync_dist`` counts every sample once: an empty chunk's step adds nothing."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any):
        self.saved = logged_tensor_states(trainer) if rows(batch) == 0 else None

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.saved is not None:
            restore_logged_tensors(trainer, self.saved)
            self.saved = None
        float_batch_counts(trainer)  # (Lightning computes the epoch's values right after the last batch)

    on_test_batch_start = on_validation_batch_start  # type: ignore[assignment]
    on_test_batch_end = on_validation_batch_end  # type: ignore[assignment]
