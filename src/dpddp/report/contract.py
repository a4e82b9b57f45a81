"""The metric contract a model meets for dpddp's promises (README, "Bring your own model and data"), and the
warning that names what is lost when a model breaks it."""

from __future__ import annotations

import difflib
import logging

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from dpddp._compat import logged_metric_kinds
from dpddp.errors import ConfigError
from dpddp.report.tally import FitTally

__all__ = ["REQUIRED", "MetricContract"]

log = logging.getLogger(__name__)

REQUIRED = {"fit": ("train/loss", "val/loss", "val/acc"), "test": ("test/loss", "test/acc")}
"""The metric names a model logs, per stage."""


class MetricContract(pl.Callback):
    """Warns, once per name, when the model breaks the metric contract: a name of ``REQUIRED`` not logged
    (``metrics.json`` has ``null``), or, under more than one process, a ``val/*`` or ``test/*`` value logged as a
    plain tensor instead of a torchmetrics ``Metric`` (not the mean over every sample once)."""

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

    def _check_exact(self, trainer: pl.Trainer, prefix: str) -> None:
        if trainer.world_size < 2:
            return
        for name, (is_metric, synced) in logged_metric_kinds(trainer).items():
            if name.startswith(prefix) and not is_metric:
                how = "averaged per rank then over ranks" if synced else "rank 0's alone (no sync_dist)"
                self._warn(
                    name,
                    f"{name} is logged as a tensor, so it is {how}, not exact over every sample: "
                    "log a torchmetrics Metric (synced sums and counts) instead",
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
            self._check_exact(trainer, "val/")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_exact(trainer, "test/")
        self._check_names(trainer, "test")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (
            trainer.current_epoch > 0 and self.tally is not None and self.tally.stepped
        ):  # at least one whole epoch, and a step in this fit (a run
            self._check_names(trainer, "fit")  # that EarlyStopping ended, continued, logs nothing)
