"""The ``auto`` strategy of a run on one process: Lightning's single-device strategy whose loaders start their
workers safely, on the device Lightning's accelerator connector fills in (``ConnectorDevices``, as ``dp``;
``test_strategies`` fails if it stops)."""

from __future__ import annotations

from typing import Any

from dpddp.parallel.dp import ConnectorDevices
from dpddp.parallel.workers import start_workers_safely

__all__ = ["OneProcessStrategy"]


class OneProcessStrategy(ConnectorDevices):
    """One process on one device (``strategy=auto``): Lightning's ``SingleDeviceStrategy`` on the device that
    Lightning's connector puts in ``parallel_devices`` (from ``accelerator`` and ``devices``), whose every loader of
    every stage, the user's own too, starts its workers safely (``start_workers_safely``), as under ddp."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(start_workers=start_workers_safely, **kwargs)
