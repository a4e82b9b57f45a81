"""``last.ckpt`` at intervals, without stopping (``checkpoint.every_n_steps``, ``checkpoint.every_seconds``)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as pl

from dpddp.cluster import cluster_world_size
from dpddp.continuity.io import BACKGROUND, AtomicCheckpointIO
from dpddp.errors import checked_float, checked_int

CHECKPOINT_KEYS = ("every_n_steps", "every_seconds")
AUTO_EVERY_SECONDS = 600.0
"""``checkpoint.every_seconds=auto`` under a cluster launcher (torchrun, SLURM, a PyTorchJob)."""


def checkpoint_intervals(cfg: Mapping) -> tuple[int | None, float | None]:
    """``(checkpoint.every_n_steps, checkpoint.every_seconds)``, ``None`` when off (``auto``: 600 s under a cluster
    launcher). Raises ``ConfigError`` for a value that is not null, positive (or ``auto``)."""
    section = cfg.get("checkpoint") or {}
    steps, seconds = section.get("every_n_steps"), section.get("every_seconds")
    if steps is not None:
        checked_int("checkpoint.every_n_steps", steps, 1, "use a positive number of optimizer steps, or null (off)")
    if seconds == "auto":
        seconds = AUTO_EVERY_SECONDS if cluster_world_size(cfg.get("cluster", "auto")) is not None else None
    elif seconds is not None:
        fix = "use a positive number of seconds, auto (600 under torchrun, SLURM, a PyTorchJob) or null (off)"
        checked_float("checkpoint.every_seconds", seconds, math.nextafter(0.0, 1.0), math.inf, fix)
    if (cfg.get("trainer") or {}).get("enable_checkpointing") is False:
        return None, None
    return steps, seconds


class IntervalCheckpoints:
    """Writes ``<dirpath>/last.ckpt`` in the background at a step boundary every ``every_n_steps`` steps, or
    ``every_s`` seconds once the ranks agree (in ``StepBoundaryStop``'s agreement)."""

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = None, every_s: float | None = None) -> None:
        self.path, self.every_n_steps, self.every_s = Path(dirpath) / "last.ckpt", every_n_steps, every_s
        self.start(0)

    def start(self, step: int) -> None:
        """A fit starts at ``step``: the intervals count from here."""
        self._step, self._at, self._due = step, time.monotonic(), False

    def time_due(self) -> bool:
        """Whether ``every_s`` has passed on this rank."""
        return self.every_s is not None and time.monotonic() - self._at >= self.every_s

    def agreed_due(self) -> None:
        """Some rank found the time due: write at the next step boundary."""
        self._due = True

    def at_step_boundary(self, trainer: pl.Trainer) -> None:
        """After an optimizer step: write when a step or time interval is due."""
        every, step = self.every_n_steps, trainer.global_step
        if step > self._step and (self._due or (every and step // every > self._step // every)):
            self._step, self._due = step, False
            background = isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
            trainer.save_checkpoint(self.path, weights_only=False, storage_options=BACKGROUND if background else None)
            self._at = time.monotonic()
