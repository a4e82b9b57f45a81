"""Stopping a whole sweep on SIGTERM, in whichever local process its launcher runs the jobs (case 20).

The basic launcher runs a sweep's jobs in the sweep's own process; ``hydra/launcher=joblib`` runs them in loky
worker processes, ``hydra/launcher=submitit_local`` each in a submitit job process under a controller process.
Neither launcher stops its jobs when the sweep's process gets SIGTERM: loky's workers and submitit's controllers
outlive it and their jobs train on (submitit's job processes only log a SIGTERM), and what they offer to end
jobs kills them without a checkpoint (loky: SIGKILL to the worker tree; submitit: SIGINT, then SIGKILL).

So a sweep stops through a file, ``<sweep dir>/.stop``, that every process of the sweep can see:

- the sweep's process (``start``, called by the summary callback when the multirun starts) removes an earlier
  invocation's file, names it in ``$DPDDP_SWEEP_STOP`` (inherited by the workers, job processes and ranks
  started after) and writes it when it gets SIGTERM;
- each job (``dpddp.entry.hydra.run``) ``watch``es for SIGTERM in its own process for as long as that process
  lives, writes the file when it gets one or when its fit was stopped by one (a SIGTERM to any process of the
  sweep stops the sweep, as a SIGTERM to any rank stops a run), and does not start once the file is there;
- a running fit (``dpddp.run.callbacks.Preemption``) looks for it at its SIGTERM checks, at most every 0.25 s,
  and stops at the next step end with ``last.ckpt`` as on a SIGTERM of its own.

The jobs then return to their launcher as usual (a stopped job stays resumable), the launcher returns, and the
summary callback writes the summary, prints the line that resumes the sweep and exits with status 143; loky's
workers and submitit's controllers then end as after any sweep.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

__all__ = ["ENV", "STOP_FILE", "active", "clear", "request", "requested", "start", "watch"]

ENV = "DPDDP_SWEEP_STOP"
"""The environment variable naming the stop file of the sweep this process belongs to."""
STOP_FILE = ".stop"

_requested = False
_watching = False


def start(sweep_dir: str | Path) -> None:
    """In the sweep's own process, before any job starts: forget an earlier invocation's stop, name the stop
    file for the processes started from now on, and ``watch``."""
    path = Path(sweep_dir).absolute() / STOP_FILE
    path.unlink(missing_ok=True)
    os.environ[ENV] = str(path)
    watch()


def active() -> bool:
    """Whether this process belongs to a sweep that stops as one (its process called ``start``)."""
    return ENV in os.environ


def watch() -> None:
    """From now on a SIGTERM to this process stops the sweep (``request``) instead of ending the process; the
    fit's own handler takes over while a fit runs and hands back to this one after it."""
    global _watching
    if not _watching and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        _watching = True


def _on_sigterm(signum: int, frame: Any) -> None:
    request()


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
    """Whether this process's sweep is stopping: it was told to, or the stop file is there (``False`` outside a
    sweep that stops as one)."""
    path = os.environ.get(ENV)
    return path is not None and (_requested or os.path.exists(path))


def clear() -> None:
    """In the sweep's own process, when it ends: remove the stop file (the summary records the stop)."""
    if path := os.environ.get(ENV):
        Path(path).unlink(missing_ok=True)
