"""The project's errors and the exit status of each: the one table every entry point maps them through.

| error | exit status | what the user sees |
| --- | --- | --- |
| ``ConfigError`` | 2 | ``error: <setting>=<value> ...: <fix>``, before anything starts |
| ``WriteFailed`` | 1 | ``error: cannot write last.ckpt in '<dir>': No space left on device`` |
| ``RankFailed`` | 1 | ``error: rank 1 (pid N) was killed by SIGKILL; ending the run (...)`` |
| ``Preempted`` | 143 (128 + SIGTERM, as a shell reports it) | ``error: stopped by SIGTERM ...`` |
| any other exception | 1 | its traceback |

Nothing here imports torch or Lightning: every layer, the parallel plumbing included, can raise these.
"""

from __future__ import annotations

import signal
from pathlib import Path

__all__ = [
    "EXIT_CONFIG",
    "EXIT_CRASH",
    "EXIT_PREEMPTED",
    "ConfigError",
    "Preempted",
    "RankFailed",
    "WriteFailed",
    "exit_status",
    "first_line",
]

EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 128 + signal.SIGTERM


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line: the setting, the value, the fix."""


class RankFailed(RuntimeError):
    """A launched rank ended with a non-zero status, and rank 0's run failed with it (the message says which
    rank, its pid and status, and rank 0's own error)."""


class Preempted(RuntimeError):
    """The run stopped on SIGTERM: in training after a checkpoint was written, or outside it (start-up, the test
    after the fit) with the run's last checkpoint, if it has one.

    Args:
        path: the checkpoint to resume from; ``None``: the run stopped before writing one.
        step: the global step (optimizer steps) it holds.
    """

    def __init__(self, path: Path | None, step: int) -> None:
        where = f"after step {step}; checkpoint: {path}" if path is not None else "before its first checkpoint"
        super().__init__(f"stopped by SIGTERM {where}")
        self.path, self.step = path, step


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
    """``"<Type>: <first line of the message>"`` (at most ``limit`` characters of message): an error for a
    one-line report."""
    text = (str(err).splitlines() or [""])[0][:limit]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
