"""A sweep's stop file, ``<sweep dir>/.stop``: how every process of a sweep learns that it stops."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DPDDP_SWEEP_STOP"
STOP_FILE = ".stop"

_requested = False


def active() -> bool:
    """Whether this process belongs to a sweep that stops as one."""
    return ENV in os.environ


def request() -> None:
    """Stop the sweep: here, and through the stop file, everywhere."""
    global _requested
    _requested = True
    if path := os.environ.get(ENV):
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).touch()
        except OSError:
            pass  # an unwritable sweep directory: this process still stops


def requested() -> bool:
    """Whether this process's sweep is stopping."""
    path = os.environ.get(ENV)
    return path is not None and (_requested or os.path.exists(path))


def clear() -> None:
    """Remove the stop file (the sweep's process, at its end)."""
    if path := os.environ.get(ENV):
        Path(path).unlink(missing_ok=True)
