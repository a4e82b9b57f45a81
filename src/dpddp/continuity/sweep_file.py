"""A sweep's stop file, ``<sweep dir>/.stop``: how every process of a sweep learns that it stops (its SIGTERM
handler is ``dpddp.continuity.stop.watch``'s). Launchers' workers outlive the sweep's process and end jobs
without a checkpoint, so they cannot be asked."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV", "STOP_FILE", "active", "clear", "request", "requested"]

ENV = "DPDDP_SWEEP_STOP"
"""The environment variable naming the stop file of the sweep this process belongs to."""
STOP_FILE = ".stop"

_requested = False


def active() -> bool:
    """Whether this process belongs to a sweep that stops as one (its process called ``start``)."""
    return ENV in os.environ


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
