"""The one owner of SIGTERM: every handler dpddp installs is installed here, composing with the one it finds and
putting it back when its scope ends. Scopes, innermost first: the training loop (``StepBoundaryStop``), a run
(``run_stops``), a sweep (``start``, ``watch``: the stop file ``<sweep dir>/.stop``). See docs/design-notes.md
(continuity.stop).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from dpddp._compat import disable_sigterm_broadcast, restore_sigterm_broadcast
from dpddp.errors import Preempted

__all__ = ["ENV", "STOP_FILE", "StepBoundaryStop", "active", "clear", "request", "requested", "run_stops"]
__all__ += ["RunScope", "start", "starting_up", "watch"]

ENV = "DPDDP_SWEEP_STOP"
"""The environment variable naming the stop file of the sweep this process belongs to."""
STOP_FILE = ".stop"

_requested = False
_watching = False


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signals reach the main thread only


def _install(handler: Callable[[int, Any], None]) -> Any:
    """Install ``handler`` for SIGTERM; return the handler it replaced."""
    return signal.signal(signal.SIGTERM, handler)


def _put_back(previous: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


# -- the sweep ---------------------------------------------------------------------------------------------


def start(sweep_dir: str | Path) -> None:
    """In the sweep's own process, before any job starts: forget an earlier invocation's stop, name the stop
    file for the processes started from now on (``$DPDDP_SWEEP_STOP``), and ``watch``."""
    path = Path(sweep_dir).absolute() / STOP_FILE
    path.unlink(missing_ok=True)
    os.environ[ENV] = str(path)
    watch()


def active() -> bool:
    """Whether this process belongs to a sweep that stops as one (its process called ``start``)."""
    return ENV in os.environ


def watch() -> None:
    """From now on, for this process's life, a SIGTERM stops the sweep (``request``) instead of ending the
    process; the inner scopes compose with this handler."""
    global _watching
    if not _watching and _on_main_thread():
        _install(lambda signum, frame: request())
        _watching = True


def request() -> None:
    """Stop the sweep: this process starts no more jobs, and the stop file tells every other one."""
    global _requested
    _requested = True
    if path := os.environ.get(ENV):
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).touch()
        except OSError:
            pass  # an unwritable sweep directory: this process still stops


def requested() -> bool:
    """Whether this process's sweep is stopping (``False`` outside a sweep that stops as one)."""
    path = os.environ.get(ENV)
    return path is not None and (_requested or os.path.exists(path))


def clear() -> None:
    """In the sweep's own process, when it ends: remove the stop file (the summary records the stop)."""
    if path := os.environ.get(ENV):
        Path(path).unlink(missing_ok=True)


# -- the run -----------------------------------------------------------------------------------------------


@dataclass
class RunScope:
    """A run's SIGTERM scope: its trainer once built; during ``starting_up`` a SIGTERM is held to the end of it
    (raised inside an import or an ``instantiate`` it would be reported as that step's failure)."""

    output_dir: Path
    trainer: pl.Trainer | None = None
    starting: bool = False
    held: bool = False

    def preempted(self) -> Preempted:
        last = self.output_dir / "checkpoints" / "last.ckpt"
        step = self.trainer.global_step if self.trainer is not None else 0
        return Preempted(last if last.is_file() else None, step)


@contextmanager
def run_stops(output_dir: Path) -> Iterator[RunScope]:
    """A run's scope: a SIGTERM raises ``Preempted`` with ``<output_dir>/checkpoints/last.ckpt`` (if written)
    and the global step; a handler found here (a sweep's) takes the signal instead, and Lightning's evaluation
    loop then ends its stage with ``SIGTERMException`` (a ``SystemExit`` of status 0), which becomes
    ``Preempted`` too."""
    scope = RunScope(output_dir)
    if not _on_main_thread():
        yield scope
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if callable(previous):
            previous(signum, frame)
        elif scope.starting:
            scope.held = True
        else:
            raise scope.preempted()

    previous = _install(on_sigterm)
    try:
        yield scope
    except SIGTERMException as err:
        raise scope.preempted() from err
    finally:
        _put_back(previous)


@contextmanager
def starting_up(scope: RunScope) -> Iterator[None]:
    """The run's start-up (the check, building the model, data and trainer): a SIGTERM in it raises
    ``Preempted`` when it ends."""
    scope.starting = True
    try:
        yield
    finally:
        scope.starting = False
    if scope.held:
        raise scope.preempted()


# -- the training loop -------------------------------------------------------------------------------------


class StepBoundaryStop(pl.Callback):
    """Stops the fit on SIGTERM to any rank within about ``interval_s`` seconds, on every rank, at an optimizer-step
    boundary: writes ``last.ckpt`` under ``dirpath`` and raises ``Preempted``. Under DDP, one ``all_reduce(MAX)``
    every 1 to 1000 steps (docs/design-notes.md, continuity.stop).
    """

    def __init__(self, dirpath: str | Path, interval_s: float = 1.0) -> None:
        self.dirpath, self.interval_s = Path(dirpath), interval_s
        self.requested = False
        self._before_fit: Any = None  # the handler before Lightning's, put back after the fit
        self._replaced = False
        self._every, self._steps, self._since = 1, 0, 0.0
        self._sweep_checked = 0.0
        self._agreed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True
        if active():
            request()  # the sweep's other jobs stop now, not after this one's checkpoint

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and _on_main_thread():  # before Lightning installs its handler
            self._before_fit = signal.getsignal(signal.SIGTERM)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _on_main_thread():  # after Lightning installed its handler
            _install(self._on_sigterm)
            self._replaced = True
            disable_sigterm_broadcast(trainer)
        self._every, self._steps, self._since, self._agreed = 1, 0, time.perf_counter(), False
        self.requested = self.requested or requested()  # the sweep stopped while this job was starting

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The handler from before the fit, not Lightning's: one left behind would only log a later SIGTERM.
        if self._replaced:
            _put_back(self._before_fit)
            self._replaced = False
        restore_sigterm_broadcast(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._agreed:
            self._agreed = self._agree(trainer)
        batch_idx = args[-1]  # every rank sees the same one
        window_closed = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if self._agreed and (window_closed or batch_idx + 1 >= trainer.num_training_batches):
            path = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)  # explicit: Lightning logs a line when it is unset
            raise Preempted(path, trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The fit ended between two agreements (its last steps, its last validation): agree once more, every rank.
        self._agreed = self._agreed or self._agree(trainer, at_once=True)

    def stop_after_fit(self, trainer: pl.Trainer) -> None:
        """After a fit that ended with a SIGTERM agreed at its end, once ``last.ckpt`` holds the final weights:
        raise ``Preempted`` (on every rank: they agreed)."""
        if self._agreed:
            last = self.dirpath / "last.ckpt"
            raise Preempted(last if last.is_file() else None, trainer.global_step)

    def _agree(self, trainer: pl.Trainer, at_once: bool = False) -> bool:
        """Whether any rank got SIGTERM, agreed every ``n`` steps (``at_once``: now); ``False`` in between."""
        self._steps += 1
        if self._steps < self._every and not at_once:
            return False
        if not self.requested and time.perf_counter() - self._sweep_checked >= 0.25:  # a stat, not every step
            self._sweep_checked = time.perf_counter()
            self.requested = requested()
        flag = self.requested
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            now = time.perf_counter()
            flags = torch.tensor([float(flag), (now - self._since) / self._steps], dtype=torch.float64)
            flags = flags.to(trainer.strategy.root_device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            reduced, step_s = flags.tolist()
            flag = bool(reduced)
            self._every = int(min(max(self.interval_s / max(step_s, 1e-9), 1), 1000))
            self._since = now
        self._steps = 0
        return flag
