"""Test helper for torchrun restarts (``+callbacks.kill._target_=elastic_kill.KillAt``, with ``tests/`` on
``PYTHONPATH``): the worker of global rank ``rank`` kills itself with SIGKILL at the end of the training batch
that makes global step ``step``, in torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT=0``), so the
restarted workers run on."""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl


class KillAt(pl.Callback):
    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
