"""The epoch-interval ``ReduceLROnPlateau`` steps Lightning skips across a stop, found and taken again, and a
restored schedule built for another limit than the continued run's (docs/design-notes.md, continuity.schedulers)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["built_states", "due_plateau_values", "limit_lines", "take_skipped_plateau_steps"]


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


def built_states(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """Each LR scheduler's ``state_dict`` as ``configure_optimizers`` built it (called at ``on_fit_start``, before
    Lightning restores their states)."""
    return [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]


def limit_lines(trainer: pl.Trainer, restored: list[dict[str, Any]], built: list[dict[str, Any]]) -> list[str]:
    """One line per scheduler whose build ``restored`` (the first run's, from the checkpoint) differs from this
    run's ``built``: its schedule depends on a limit (``T_max=max_epochs``, ``total_steps``) the continued run
    changed, and the restored state follows the first one."""
    lines = []
    for config, old, new in zip(trainer.lr_scheduler_configs, restored, built, strict=False):
        keys = [k for k in new if k in old and not _same(old[k], new[k])]
        shown = [k for k in keys if not k.startswith("_")] or keys
        if shown:
            was = ", ".join(f"{k}={old[k]}" for k in shown)
            now = ", ".join(f"{k}={new[k]}" for k in shown)
            lines.append(
                f"{type(config.scheduler).__name__} was built with {was} for the limit the checkpoint's run had, and "
                f"this run builds {now}: the continued run follows the first schedule, so it cannot equal a straight "
                "run to this limit; keep the first run's limit, or use a schedule that does not depend on it"
            )
    return lines


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b) or (a != a and b != b)  # nan equals nan here
