"""The one owner of SIGTERM: the loop (``StepBoundaryStop``), a run, a command, a sweep (docs/design-notes.md)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from dpddp._compat import disable_sigterm_broadcast, restore_sigterm_broadcast
from dpddp.cluster import launched, launched_by_dpddp
from dpddp.continuity.io import IntervalCheckpoints
from dpddp.diagnostics.whereabouts import AGREEMENT, entering
from dpddp.errors import Preempted, local_rank, stop_line

ENV = "DPDDP_SWEEP_STOP"  # names the sweep's stop file, <sweep dir>/.stop, that every process of the sweep sees

_requested = False


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signals reach the main thread only


def _install(handler: Any) -> Any:
    """Make ``handler`` (``None``: the default) SIGTERM's; returns the one it replaces."""
    return signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def _preempted(last: Path, step: int) -> Preempted:
    return Preempted(last if last.is_file() else None, step)


def start(sweep_dir: str | Path) -> None:
    """In the sweep's process, before any job: a fresh stop file named in ``$DPDDP_SWEEP_STOP``; ``watch``."""
    global _requested
    _requested = False
    path = Path(sweep_dir).absolute() / ".stop"
    path.unlink(missing_ok=True)
    os.environ[ENV] = str(path)
    watch()


def active() -> bool:
    """Whether this process belongs to a sweep that stops as one."""
    return ENV in os.environ


def request() -> None:
    """Stop the sweep: here, and through the stop file, everywhere (an unwritable one: here only)."""
    global _requested
    _requested = True
    if path := os.environ.get(ENV):
        with suppress(OSError):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).touch()


def requested() -> bool:
    """Whether this process's sweep is stopping."""
    path = os.environ.get(ENV)
    return path is not None and (_requested or os.path.exists(path))


def clear() -> None:
    """Remove the stop file (the sweep's process, at its end)."""
    if path := os.environ.get(ENV):
        Path(path).unlink(missing_ok=True)


def _request_on_sigterm(signum: int, frame: Any) -> None:
    request()


def watch() -> None:
    """From now on a SIGTERM stops the sweep (``request``) instead of ending this process."""
    if _on_main_thread() and signal.getsignal(signal.SIGTERM) is not _request_on_sigterm:
        previous = _install(_request_on_sigterm)
        if isinstance(previous, _Outside) and previous.take():  # the command's, before the sweep started
            request()


class Phase(Enum):
    """Where a run is, for SIGTERM (``ON_SIGTERM``, ``TRANSITIONS``)."""

    OPEN = "open"  # the scope entered, nothing started yet
    STARTING = "starting"  # the check, building the model, data and trainer (``starting_up``)
    RUNNING = "running"  # a trainer's stages (``RunScope.own`` to ``RunScope.finish``)
    TAIL = "tail"  # from the last agreement to the run's end: outputs written, launched ranks joined


class Action(Enum):
    """What a SIGTERM does: raise ``Preempted``, hold it to the phase's end, or request a step-boundary stop."""

    RAISE = "raise"
    HOLD = "hold"
    REQUEST = "request"


ON_SIGTERM = {
    Phase.OPEN: Action.RAISE,
    Phase.STARTING: Action.HOLD,
    Phase.RUNNING: Action.REQUEST,
    Phase.TAIL: Action.HOLD,
}

TRANSITIONS = {
    (Phase.OPEN, "start"): Phase.STARTING,  # starting_up begins
    (Phase.STARTING, "started"): Phase.RUNNING,  # starting_up ends, its trainer owned
    (Phase.STARTING, "failed"): Phase.OPEN,  # starting_up ends without a trainer (it raised)
    (Phase.RUNNING, "finish"): Phase.TAIL,  # the last stage's last agreement
}
"""The run's phases in order; any other (phase, event) is a bug (``RunScope.go`` raises ``RuntimeError``)."""


@dataclass
class RunScope:
    """A run's SIGTERM scope: its phase, trainer, a held SIGTERM, and the trainer's ``StepBoundaryStop``."""

    output_dir: Path
    trainer: pl.Trainer | None = None
    phase: Phase = Phase.OPEN
    held: bool = False
    stop: StepBoundaryStop | None = None

    def go(self, event: str) -> None:
        """Take ``TRANSITIONS[(phase, event)]``; raises ``RuntimeError`` for any other."""
        if (self.phase, event) not in TRANSITIONS:
            raise RuntimeError(f"no transition from {self.phase.value} on {event!r}")
        self.phase = TRANSITIONS[(self.phase, event)]

    def action(self) -> Action:
        """What a SIGTERM does now (``ON_SIGTERM``; running without a stop to request: ``RAISE``)."""
        action = ON_SIGTERM[self.phase]
        return Action.RAISE if action is Action.REQUEST and self.stop is None else action

    def preempted(self) -> Preempted:
        step = self.trainer.global_step if self.trainer is not None else 0
        return _preempted(self.output_dir / "checkpoints" / "last.ckpt", step)

    def own(self, trainer: pl.Trainer) -> None:
        """From now to ``finish``, ``trainer``'s ``StepBoundaryStop`` takes SIGTERM, not Lightning."""
        self.trainer = trainer
        self.stop = next(cb for cb in trainer.callbacks if isinstance(cb, StepBoundaryStop))  # type: ignore[attr-defined]
        disable_sigterm_broadcast(trainer)

    def finish(self) -> None:
        """After the run's last stage, on every rank: agree once more; raises ``Preempted`` on a SIGTERM."""
        stop, self.stop = self.stop, None
        self.go("finish")
        if stop is not None and self.trainer is not None:
            restore_sigterm_broadcast(self.trainer)
            if stop.agree(self.trainer):
                raise self.preempted()


@contextmanager
def run_stops(output_dir: Path) -> Iterator[RunScope]:
    """A run's scope: a SIGTERM does what ``ON_SIGTERM`` says; a sweep's handler found here is called first."""
    scope = RunScope(output_dir)
    if not _on_main_thread():
        yield scope
        return
    pid = os.getpid()

    def on_sigterm(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a copy in a forked rank, before the rank's own scope
            outside.came = True
            return
        if callable(previous):
            previous(signum, frame)
        action = scope.action()
        if action is Action.HOLD:
            scope.held = True
        elif action is Action.REQUEST and scope.stop is not None:
            scope.stop.request()
        elif not callable(previous):
            raise scope.preempted()

    previous = _install(on_sigterm)
    outside = previous if isinstance(previous, _Outside) else getattr(previous, "dpddp_outside", None) or _Outside()
    on_sigterm.dpddp_pid, on_sigterm.dpddp_outside = pid, outside  # type: ignore[attr-defined]
    if getattr(previous, "dpddp_pid", pid) != pid or isinstance(getattr(previous, "__self__", previous), _Outside):
        previous = signal.SIG_DFL  # inherited from the launcher (a forked rank), or a command's: not this run's
    scope.held = outside.take()
    try:
        yield scope
    except SIGTERMException as err:
        raise scope.preempted() from err
    finally:  # in a ``command`` (not in a launched rank: rank 0 maps its stop), a SIGTERM from now is late
        if callable(previous) or not outside.command or launched_by_dpddp():
            _install(previous)
        else:
            outside.ended = scope
            _install(outside)
    if scope.held:
        raise scope.preempted()


@dataclass
class _Outside:
    """SIGTERM's handler outside a run's scope: records one (``came``); in a ``command``, its last run and resume."""

    command: bool = False
    came: bool = False
    ended: RunScope | None = None
    resume: Callable[[], str] | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.came = True

    def take(self) -> bool:
        came, self.came = self.came, False
        return came

    def preempted(self) -> Preempted:
        return self.ended.preempted() if self.ended is not None else Preempted(None, 0)

    def at_exit(self, signum: int, frame: Any) -> None:
        """While the process exits after its command: the stop line, exit 143."""
        if local_rank() == 0:
            os.write(2, f"error: {stop_line(self.preempted(), self.resume)}\n".encode())
        os._exit(128 + signal.SIGTERM)


@contextmanager
def command(resume: Callable[[], str]) -> Iterator[None]:
    """An entry point's command: a SIGTERM outside its run raises ``Preempted`` at the end; one after, exit 143."""
    outside = _Outside(command=True, resume=resume)
    _install(outside)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one held since the first line comes now
    try:
        yield
    except BaseException as err:
        outside.command = False
        _install(signal.SIG_DFL)  # a failed or stopped command ends by the signal while it exits
        if isinstance(err, SystemExit) and err.code in (0, None) and outside.take():  # --help, --print_config
            raise outside.preempted() from None
        raise
    outside.command = False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no signal between the check and the exit's handler
    if outside.take() or signal.SIGTERM in signal.sigpending():
        raise outside.preempted()  # SIGTERM stays blocked: the process ends with this stop
    _install(outside.at_exit if outside.ended is not None else None)  # no run, nothing to say: the default
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


@contextmanager
def starting_up(scope: RunScope) -> Iterator[None]:
    """The run's start-up: a SIGTERM in it raises ``Preempted`` at its end (a launched rank: at the first agreement)."""
    scope.go("start")
    try:
        yield
    except BaseException:
        scope.go("failed")
        raise
    scope.go("started")
    if scope.held:
        if scope.stop is None or not launched():
            raise scope.preempted()
        scope.held = False
        scope.stop.request()


@dataclass
class Pace:
    """Agree every ``every`` batches (1 to 1000, set by ``agreed`` from the slowest rank's batch time)."""

    every: int = 1
    batches: int = 0
    since: float = field(default_factory=time.perf_counter)

    def due(self) -> bool:
        self.batches += 1
        return self.batches >= self.every


def agreed(flag: int, device: torch.device, pace: Pace | None, interval_s: float) -> int:
    """The ranks' largest ``flag`` (one ``all_reduce``); ``pace``'s next due batch about ``interval_s`` on."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return int(flag)
    batch_s = (time.perf_counter() - pace.since) / max(pace.batches, 1) if pace is not None else 0.0
    flags = torch.tensor([float(flag), batch_s], dtype=torch.float64).to(device)
    with entering(AGREEMENT):
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    reduced, batch_s = flags.tolist()
    if pace is not None:
        pace.every = int(min(max(interval_s / max(batch_s, 1e-9), 1), 1000))
        pace.batches, pace.since = 0, time.perf_counter()
    return int(reduced)


class StepBoundaryStop(pl.Callback):
    """On a SIGTERM to any rank, every rank stops together (a fit: at a step boundary, after ``last.ckpt``)."""

    def __init__(self, dirpath: str | Path, intervals: IntervalCheckpoints) -> None:
        self.last, self.intervals, self.interval_s = Path(dirpath) / "last.ckpt", intervals, 1.0
        self.requested = False
        self._train, self._eval = Pace(), Pace()
        self._sweep_checked = 0.0
        self._agreed = False

    def request(self) -> None:
        """A SIGTERM reached this rank: the next agreement stops every rank."""
        self.requested = True
        if active():
            request()  # the sweep's other jobs stop now, not after this one's checkpoint

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Last, after configure_callbacks(): its checkpoint holds every other callback's step (the list is replaced).
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]  # type: ignore[attr-defined]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train, self._agreed = Pace(), False
        self._sweep_checked = 0.0  # the first batch's agreement reads the sweep's stop file, whatever came before
        self.requested = self.requested or requested()  # the sweep stopped while this job was starting
        self.intervals.start(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._agreed = self._agreed or self.agree(trainer, self._train)
        batch_idx = args[-1]  # every rank sees the same one
        window_closed = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if not (window_closed or batch_idx + 1 >= trainer.num_training_batches):
            return
        if self._agreed:
            trainer.save_checkpoint(self.last, weights_only=False)  # explicit: else Lightning logs a line
            raise Preempted(self.last, trainer.global_step)
        self.intervals.at_step_boundary(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The fit ended between two agreements (its last steps, its last validation): agree once more, every rank.
        self._agreed = self._agreed or self.agree(trainer)

    def stop_after_fit(self, trainer: pl.Trainer) -> None:
        """Once ``last.ckpt`` holds the final weights: raise ``Preempted`` if the fit's end agreed on a SIGTERM."""
        if self._agreed:
            raise _preempted(self.last, trainer.global_step)

    # Evaluation (validation in a fit or alone, its sanity check, test, predict): the same agreement per batch.
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval = Pace()

    on_sanity_check_start = on_test_start = on_predict_start = on_validation_start

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._evaluated(trainer, at_end=False)

    on_test_batch_end = on_predict_batch_end = on_validation_batch_end  # type: ignore[assignment]

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluated(trainer, at_end=True)

    on_test_end = on_predict_end = on_validation_end

    def _evaluated(self, trainer: pl.Trainer, at_end: bool) -> None:
        """After an evaluation batch or loop: stop on an agreed SIGTERM (in a fit: at its next step boundary or end)."""
        self._agreed = self._agreed or self.agree(trainer, None if at_end else self._eval)
        if self._agreed and not (trainer.state.fn == "fit" and not trainer.sanity_checking):
            raise _preempted(self.last, trainer.global_step)

    def agree(self, trainer: pl.Trainer, pace: Pace | None = None) -> bool:
        """Whether any rank got SIGTERM or its sweep stops, agreed by all: now, or at ``pace``'s due batches only."""
        if pace is not None and not pace.due():
            return False
        if not self.requested and time.perf_counter() - self._sweep_checked >= 0.25:  # a stat, not every batch
            self._sweep_checked = time.perf_counter()
            self.requested = requested()
        due = self.intervals.time_due()
        level = agreed(2 if self.requested else int(due), trainer.strategy.root_device, pace, self.interval_s)
        if level == 1:  # a time-interval write, at the next step boundary
            self.intervals.due = True
        return level == 2
