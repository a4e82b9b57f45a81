"""The project's errors, their exit statuses, and the shell every entry point's ``main`` runs in (no torch)."""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from dpddp.messages import without_torch_prefixes

EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 128 + signal.SIGTERM


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line: the setting, the value, the fix."""


class RankFailed(RuntimeError):
    """A launched rank ended with a non-zero status; the message names it and rank 0's own error."""


class LoaderFailed(RuntimeError):
    """A DataLoader worker was stuck or died; the message names the rank, the setting and the fix."""


class StepFailed(RuntimeError):
    """A training step failed for a known cause (a parameter without a gradient under DDP)."""


class ReplicasDiverged(RuntimeError):
    """The ranks' weights or optimizer state differ; the message names the rank, the step and the tensor."""


class Preempted(RuntimeError):
    """The run stopped on SIGTERM; ``path``: the checkpoint to resume from (``None``: none yet), at ``step``."""

    def __init__(self, path: Path | None, step: int) -> None:
        where = f"after step {step}; checkpoint: {path}" if path is not None else "before its first checkpoint"
        super().__init__(f"stopped by SIGTERM {where}")
        self.path, self.step = path, step


class PromiseBroken(RuntimeError):
    """A promise ``python -m dpddp.check`` measured on the user's model does not hold."""


class WriteFailed(RuntimeError):
    """An output could not be written; the message names the file and the system's error."""


def exit_status(err: BaseException) -> int:
    return EXIT_CONFIG if isinstance(err, ConfigError) else EXIT_PREEMPTED if isinstance(err, Preempted) else EXIT_CRASH


def first_line(err: BaseException, limit: int = 200) -> str:
    """``"<Type>: <first line of the message>"``, at most ``limit`` characters, without torch's prefixes."""
    text = without_torch_prefixes((str(err).splitlines() or [""])[0])[:limit]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def checked_int(name: str, value: Any, low: int, fix: str, high: int | None = None) -> int:
    """``value``, an integer (not a bool) in ``[low, high]``; else ``ConfigError`` naming ``name`` and ``fix``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not an integer: {fix}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")
    return value


def checked_float(name: str, value: Any, low: float, high: float, fix: str) -> float:
    """``value`` as a finite float (not a bool) in ``[low, high]``; else ``ConfigError`` naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")
    return float(value)


# The errors an entry point reports in one line; any other shows its traceback.
KNOWN = (ConfigError, RankFailed, Preempted, WriteFailed, LoaderFailed, StepFailed, ReplicasDiverged, PromiseBroken)


def fail(line: str, status: int = EXIT_CONFIG, log: logging.Logger | None = None) -> NoReturn:
    """Say ``error: <line>`` on stderr (or ``log``), a bad setting once per node; exit with ``status``."""
    if log is None and status == EXIT_CONFIG and local_rank():
        log_quietly(logging.getLogger(__name__), f"error: {line}")
    elif log is None:
        print(f"error: {line}", file=sys.stderr)
    else:
        log.error(f"error: {line}")
    sys.exit(status)


def local_rank() -> int:
    """This process's local rank from its launcher (``LOCAL_RANK``: torchrun; ``SLURM_LOCALID``), else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def stop_line(err: Preempted, resume: Callable[[], str] | None) -> str:
    return f"{err}: resume with {resume()}" if resume is not None else str(err)


def exit_on(err: BaseException, resume: Callable[[], str] | None = None, log: logging.Logger | None = None) -> NoReturn:
    """``fail`` with ``err``'s message and exit status; a ``Preempted`` line (``stop_line``) once per node."""
    if isinstance(err, Preempted) and local_rank():
        log_quietly(log or logging.getLogger(__name__), str(err))
        sys.exit(EXIT_PREEMPTED)
    line = stop_line(err, resume) if isinstance(err, Preempted) else str(err)
    fail(line, exit_status(err), log)


def log_quietly(log: logging.Logger, message: str) -> None:
    """``message`` at INFO into the log files of ``log`` and its ancestors only (not the console), else at DEBUG."""
    files: list[logging.Handler] = []
    logger: logging.Logger | None = log
    while logger is not None:
        files += [h for h in logger.handlers if isinstance(h, logging.FileHandler) and h.level <= logging.INFO]
        logger = logger.parent if logger.propagate else None
    if not files or not log.isEnabledFor(logging.INFO):
        log.debug(message)
        return
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), None)
    for handler in files:
        handler.handle(record)


def rank_status(err: BaseException, log: logging.Logger) -> int:
    """In a launched rank: log ``err`` (a known one's line, a ``Preempted`` to file, else traceback); its status."""
    if isinstance(err, (ConfigError, LoaderFailed, StepFailed, ReplicasDiverged)):
        log.error(f"error: {err}")
    elif isinstance(err, Preempted):
        log_quietly(log, str(err))
    else:
        log.exception("rank failed")
    return exit_status(err)


@contextmanager
def shell(
    resume: Callable[[], str] | None = None,
    log: logging.Logger | None = None,
    *,
    bad_input: tuple[type[Exception], ...] = (),
    crash: str | None = None,
    rank: logging.Logger | None = None,
) -> Iterator[None]:
    """The body of an entry point's ``main``: a ``KNOWN`` error ends the process through ``exit_on``; one of
    ``bad_input``: exit 2; with ``crash``, any other but a ``ConfigError`` or ``PromiseBroken``: ``error: <crash>:
    <first_line>``, exit 1; in a launched rank (``rank``): ``rank_status``. Anything else propagates."""
    try:
        yield
    except Exception as err:
        if rank is not None:
            sys.exit(rank_status(err, rank))
        if isinstance(err, bad_input):
            fail(str(err))
        if crash is not None and not isinstance(err, (ConfigError, PromiseBroken)):
            fail(f"{crash}: {first_line(err)}", EXIT_CRASH)
        if not isinstance(err, KNOWN):
            raise
        exit_on(err, resume, log if isinstance(err, RankFailed) else None)


def resume_command(program: Sequence[str], args: Iterable[str], drop: tuple[str, ...], add: Iterable[str]) -> str:
    """A POSIX shell command: ``program``, ``args`` except those starting with one of ``drop``, then ``add``."""
    return shlex.join([*program, *(a for a in args if not a.startswith(drop)), *add])


def invocation_name(first: str, n: int) -> str:
    """What the ``n``-th invocation (from 1) into a run directory writes: ``first``, then ``config-1.yaml``, ..."""
    return first if n == 1 else f"{Path(first).stem}-{n - 1}{Path(first).suffix}"


def invocations(run_dir: str | Path, first: str) -> list[Path]:
    """What the invocations into ``run_dir`` so far wrote (``invocation_name``), in order."""
    found: list[Path] = []
    while (path := Path(run_dir) / invocation_name(first, len(found) + 1)).exists():
        found.append(path)
    return found


def log_to(path: Path, fmt: str) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr), logging.FileHandler(path)]
    logging.basicConfig(level=logging.INFO, format=fmt, handlers=handlers, force=True)


def unwritable(directory: str | Path) -> str | None:
    """Why files cannot be written in ``directory`` (the system's reason), or ``None``; makes it, and tries a file."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return "Not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None
