"""The project's errors and the exit status of each: the one table every entry point maps them through.

| error | exit status | what the user sees |
| --- | --- | --- |
| ``ConfigError`` | 2 | ``error: <setting>=<value> ...: <fix>``, before anything starts |
| ``WriteFailed`` | 1 | ``error: cannot write last.ckpt in '<dir>': No space left on device: <fix>`` |
| ``RankFailed`` | 1 | ``error: rank 1 (pid N) was killed by SIGKILL; ending the run (...)`` |
| ``LoaderFailed`` | 1 | ``error: rank 1: a DataLoader worker sent no batch for 60 s (data.num_workers > 0): <fix>`` |
| ``StepFailed`` | 1 | ``error: rank 0: a parameter got no gradient in the last training step (...): <fix>`` |
| ``ReplicasDiverged`` | 1 | ``error: rank 1's replica differs from the others' at step 6, first in linear.weight`` |
| ``Preempted`` | 143 (128 + SIGTERM, as a shell reports it) | ``error: stopped by SIGTERM ...`` |
| ``PromiseBroken`` | 1 | ``error: promise 1 does not hold for this model: ...`` (``python -m dpddp.check``) |
| a main's own bad input (``shell(bad_input=...)``) | 2 | ``error: no metrics.csv in <dir> ...`` (``dpddp.plot``) |
| under ``shell(crash=...)``, any other error | 1 | ``error: a check training failed: <Type>: <line>`` |
| any other exception | 1 | its traceback (a launched rank: into its log) |

Also the shell every entry point's ``main`` runs its body in (``shell``): that policy; and the resume command, the
numbering of the invocations into a run directory and the log set-up. Nothing here imports torch or Lightning:
every layer can use it.
"""

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

__all__ = [
    "EXIT_CONFIG",
    "EXIT_CRASH",
    "EXIT_PREEMPTED",
    "KNOWN",
    "ConfigError",
    "LoaderFailed",
    "Preempted",
    "PromiseBroken",
    "RankFailed",
    "ReplicasDiverged",
    "StepFailed",
    "WriteFailed",
    "checked_float",
    "checked_int",
    "exit_on",
    "exit_status",
    "fail",
    "first_line",
    "invocation_name",
    "invocations",
    "local_rank",
    "log_quietly",
    "log_to",
    "rank_status",
    "resume_command",
    "shell",
    "stop_line",
    "unwritable",
]

EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 128 + signal.SIGTERM


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line: the setting, the value, the fix."""


class RankFailed(RuntimeError):
    """A launched rank ended with a non-zero status, and rank 0's run failed with it (the message says which
    rank, its pid and status, and rank 0's own error)."""


class LoaderFailed(RuntimeError):
    """A DataLoader worker process was stuck (no batch within the loader's timeout) or died; the message names
    the rank, what torch saw, the setting (``data.num_workers``) and what to do."""


class StepFailed(RuntimeError):
    """A training step failed for a cause dpddp knows (DistributedDataParallel found a parameter the loss did not
    use); the message names the rank, the cause and the setting that fixes it."""


class ReplicasDiverged(RuntimeError):
    """The ranks' weights or optimizer state differ (``dpddp.continuity.replicas``); the message names the first
    rank that differs, the step and the first tensor."""


class Preempted(RuntimeError):
    """The run stopped on SIGTERM, with ``path``, the checkpoint to resume from (``None``: none written yet),
    holding global step ``step``."""

    def __init__(self, path: Path | None, step: int) -> None:
        where = f"after step {step}; checkpoint: {path}" if path is not None else "before its first checkpoint"
        super().__init__(f"stopped by SIGTERM {where}")
        self.path, self.step = path, step


class PromiseBroken(RuntimeError):
    """A promise ``python -m dpddp.check`` measured on the user's model does not hold; the message says which,
    by how much and, where known, why."""


class WriteFailed(RuntimeError):
    """An output (a checkpoint, ``metrics.json``) could not be written: a full disk, an I/O error. The message
    names the file, its directory and the system's error; the earlier file is left whole."""


def exit_status(err: BaseException) -> int:
    """The process exit status for ``err`` (see the module's table)."""
    if isinstance(err, ConfigError):
        return EXIT_CONFIG
    if isinstance(err, Preempted):
        return EXIT_PREEMPTED
    return EXIT_CRASH


def first_line(err: BaseException, limit: int = 200) -> str:
    """``"<Type>: <first line of the message>"`` (at most ``limit`` characters of message, without torch's
    ``Future.then`` prefixes and a C++ source location: ``dpddp.messages.without_torch_prefixes``): an error for
    a one-line report."""
    text = without_torch_prefixes((str(err).splitlines() or [""])[0])[:limit]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def checked_int(name: str, value: Any, low: int, fix: str, high: int | None = None) -> int:
    """``value``, an integer (not a bool) in ``[low, high]``; else a ``ConfigError``: ``<name>=<value> is not an
    integer: <fix>`` or ``... is invalid: <fix>``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not an integer: {fix}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")
    return value


def checked_float(name: str, value: Any, low: float, high: float, fix: str) -> float:
    """``value`` as a float, a finite number (not a bool) in ``[low, high]``; else a ``ConfigError``:
    ``<name>=<value> is invalid: <fix>``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")
    return float(value)


# The errors an entry point reports in one line; any other is raised on and shows its traceback (under train.py
# Hydra's short one, the full one with HYDRA_FULL_ERROR=1).
KNOWN = (ConfigError, RankFailed, Preempted, WriteFailed, LoaderFailed, StepFailed, ReplicasDiverged, PromiseBroken)


def fail(line: str, status: int = EXIT_CONFIG, log: logging.Logger | None = None) -> NoReturn:
    """End the process: ``error: <line>`` on stderr, or through ``log`` (its handlers: a run's ``train.log``
    too), and exit with ``status``. A bad setting (``EXIT_CONFIG``, no ``log``) is said once per node: under a
    cluster's launcher (torchrun, SLURM) every process checks the same command line and config, and one of local
    rank other than 0 only logs it (``log_quietly``)."""
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
    """A stop's line after ``error: ``: ``err``'s message, ending with ``: resume with <resume()>`` when ``resume``
    is given."""
    return f"{err}: resume with {resume()}" if resume is not None else str(err)


def exit_on(err: BaseException, resume: Callable[[], str] | None = None, log: logging.Logger | None = None) -> NoReturn:
    """``fail`` with ``err``'s message and exit status (the module's table); a ``Preempted`` line ends with
    ``: resume with <resume()>`` when ``resume`` is given, and is said once per node: under a cluster's launcher
    (torchrun, SLURM) a process of local rank other than 0 logs it (``log_quietly``) and exits with its status."""
    if isinstance(err, Preempted) and local_rank():
        log_quietly(log or logging.getLogger(__name__), str(err))
        sys.exit(EXIT_PREEMPTED)
    line = stop_line(err, resume) if isinstance(err, Preempted) else str(err)
    fail(line, exit_status(err), log)


def log_quietly(log: logging.Logger, message: str) -> None:
    """``message`` at INFO into the log files of ``log`` (the ``FileHandler``s it and its ancestors send to:
    a rank's ``rank<N>.log``, a run's ``train.log``), not to the console; at DEBUG where there is none."""
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
    """In a launched rank: log ``err`` (a ``ConfigError``, ``LoaderFailed``, ``StepFailed``, ``ReplicasDiverged`` as
    ``error: <message>``, a ``Preempted`` as its message into the log file only (``log_quietly``): a stop, not an
    error, whose one line rank 0 says; anything else with its traceback) and return its exit status."""
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
    """The body of an entry point's ``main``: an error raised in it ends the process through the module's table.

    - an error of the table (``KNOWN``): ``exit_on`` (``resume`` for a stop's line; a lost rank's line,
      ``RankFailed``, goes into the run's ``log`` too);
    - one of ``bad_input`` (the main's own bad input): ``error: <message>``, exit 2;
    - with ``crash``, any error but a ``ConfigError`` or ``PromiseBroken`` (a tool whose trainings are its means):
      ``error: <crash>: <Type>: <first line>``, exit 1;
    - in a launched rank (``rank``, its log): every error through ``rank_status``, exit with its status;
    - any other exception propagates (its traceback); ``SystemExit`` and ``KeyboardInterrupt`` pass."""
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
    """The command that continues a stopped run, to paste into a POSIX shell (any directory name quoted):
    ``program``, then the arguments ``args`` except those starting with one of ``drop``, then ``add``."""
    return shlex.join([*program, *(a for a in args if not a.startswith(drop)), *add])


def invocation_name(first: str, n: int) -> str:
    """The name of what the ``n``-th invocation (from 1) into one run directory writes: ``first``, then ``first``
    numbered before its suffix: ``.hydra``, ``.hydra-1``, ... or ``config.yaml``, ``config-1.yaml``, ..."""
    path = Path(first)
    return first if n == 1 else f"{path.stem}-{n - 1}{path.suffix}"


def invocations(run_dir: str | Path, first: str) -> list[Path]:
    """What the invocations into ``run_dir`` so far wrote (``invocation_name``), in order; the next invocation is
    number ``len(...) + 1``, so none overwrites an earlier one's."""
    found: list[Path] = []
    while (path := Path(run_dir) / invocation_name(first, len(found) + 1)).exists():
        found.append(path)
    return found


def log_to(path: Path, fmt: str) -> None:
    """Send log records of level INFO and above to stderr and to the file ``path``, formatted by ``fmt``
    (replacing any handlers set before: a forked rank inherits its parent's)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr), logging.FileHandler(path)]
    logging.basicConfig(level=logging.INFO, format=fmt, handlers=handlers, force=True)


def unwritable(directory: str | Path) -> str | None:
    """Why files cannot be written in ``directory`` (the system's reason: ``"Read-only file system"``,
    ``"Not a directory"``), or ``None``. Makes the directory (with its parents) and writes one unnamed file in it
    (``O_TMPFILE`` where the system has it: nothing is left behind, even by a kill)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return "Not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None
