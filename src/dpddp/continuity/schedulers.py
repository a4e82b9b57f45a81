"""The epoch-interval ``ReduceLROnPlateau`` steps Lightning skips across a stop, found and taken again
(docs/design-notes.md, continuity.schedulers)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["due_plateau_values", "take_skipped_plateau_steps"]


def _due(trainer: pl.Trainer, epoch: int) -> list[tuple[int, Any]]:
    """``(index, config)`` of the epoch-interval plateau schedulers Lightning steps at the end of ``epoch``."""
    configs = trainer.lr_scheduler_configs if trainer.lightning_module.automatic_optimization else []
    return [
        (i, c)
        for i, c in enumerate(configs)
        if c.reduce_on_plateau and c.interval == "epoch" and (epoch + 1) % c.frequency == 0
    ]


def due_plateau_values(trainer: pl.Trainer) -> dict[int, float]:
    """At a checkpoint written after the current epoch's last batch and before its end: the monitored value of
    each plateau step still due, by scheduler index (a value not logged yet is left out)."""
    metrics = trainer.callback_metrics
    return {i: float(metrics[c.monitor]) for i, c in _due(trainer, trainer.current_epoch) if c.monitor in metrics}


def take_skipped_plateau_steps(trainer: pl.Trainer, epoch: int, saved: dict[int, float]) -> None:
    """Take the plateau steps of the end of ``epoch`` (the restored one, now ended): with the value ``saved``
    at the checkpoint, or else the one this fit logged."""
    module, metrics = trainer.lightning_module, trainer.callback_metrics
    for i, config in _due(trainer, epoch):
        value = saved.get(i, metrics[config.monitor] if config.monitor in metrics else None)
        if value is not None:
            module.lr_scheduler_step(config.scheduler, value)
