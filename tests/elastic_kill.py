"""Test helpers for torchrun restarts and membership changes (``+callbacks.<name>._target_=elastic_kill.<Class>``,
with ``tests/`` on ``PYTHONPATH``). Each acts once, in the start it is meant for, at the end of the training
batch that makes global step ``step``, so the later starts run on:

- ``KillAt``: the worker of global rank ``rank`` kills itself with SIGKILL (torchrun's first attempt only,
  ``TORCHELASTIC_RESTART_COUNT=0``);
- ``KillNodeAt``: the worker of global rank ``rank`` kills its torchrun agent and itself with SIGKILL (a node lost
  abruptly), in a start of ``world_size`` processes;
- ``TermAgentAt``: the worker of global rank ``rank`` sends SIGTERM to its torchrun agent (a spot instance's
  preemption notice to one node) in a start of ``world_size`` processes, and waits until the agent has passed it
  on to this worker; every rank agrees on a stop at each step (``StepBoundaryStop.interval_s=0``), and the stop's
  check comes after this callback, so the run stops at this step on every rank;
- ``HoldAlone``: global rank 0 of a one-process start (agreeing at each step too) holds at ``step`` until it
  gets SIGTERM (its agent stopping it for a node that joins), at most ``limit_s`` seconds, after writing
  ``<cwd>/held`` for the test to see.

``KillNodeAt`` and ``TermAgentAt`` write ``<cwd>/lost`` first (the time, for the test's figures). ``StartSteps``
appends each start's first global step to ``<cwd>/starts`` (global rank 0).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl

from dpddp.continuity.stop import StepBoundaryStop


class KillAt(pl.Callback):
    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class KillNodeAt(pl.Callback):
    def __init__(self, step: int, rank: int = 1, world_size: int = 2) -> None:
        self.step, self.rank, self.world_size = step, rank, world_size

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if (trainer.world_size, trainer.global_rank, trainer.global_step) == (self.world_size, self.rank, self.step):
            _mark("lost")
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def _mark(name: str) -> None:
    """``<cwd>/<name>`` holding the wall-clock time, for the test's figures (the time to continue)."""
    Path(name).write_text(f"{time.time()}\n")


def _stops(trainer: pl.Trainer) -> list[StepBoundaryStop]:
    return [cb for cb in trainer.callbacks if isinstance(cb, StepBoundaryStop)]  # type: ignore[attr-defined]


class _StopEachStep(pl.Callback):
    """Every rank agrees on a stop at each step (``StepBoundaryStop.interval_s=0``)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for stop in _stops(trainer):
            stop.interval_s = 0.0


class TermAgentAt(_StopEachStep):
    def __init__(self, step: int, rank: int = 1, world_size: int = 2, limit_s: float = 60.0) -> None:
        self.step, self.rank, self.world_size, self.limit_s = step, rank, world_size, limit_s

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if (trainer.world_size, trainer.global_rank, trainer.global_step) != (self.world_size, self.rank, self.step):
            return
        _mark("lost")
        os.kill(os.getppid(), signal.SIGTERM)
        deadline = time.monotonic() + self.limit_s
        while not all(stop.requested for stop in _stops(trainer)) and time.monotonic() < deadline:
            time.sleep(0.05)


class HoldAlone(_StopEachStep):
    def __init__(self, step: int, limit_s: float = 120.0) -> None:
        self.step, self.limit_s = step, limit_s

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if (trainer.world_size, trainer.global_rank, trainer.global_step) != (1, 0, self.step):
            return
        _mark("held")
        deadline = time.monotonic() + self.limit_s
        while not all(stop.requested for stop in _stops(trainer)) and time.monotonic() < deadline:
            time.sleep(0.05)


class StartSteps(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            with open("starts", "a") as f:
                f.write(f"{trainer.global_step}\n")
