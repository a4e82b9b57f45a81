"""The ``auto`` strategy of a run on one process: Lightning's single-device strategy whose loaders start their
workers safely. Relies on Lightning's accelerator connector filling ``parallel_devices`` (Lightning 2.6.6), as
``dpddp.parallel.dp`` does (``test_strategies`` fails if not)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from dpddp.parallel.workers import start_workers_safely

__all__ = ["OneProcessStrategy"]


class OneProcessStrategy(SingleDeviceStrategy):
    """One process on one device (``strategy=auto``): Lightning's ``SingleDeviceStrategy`` on the device that
    Lightning's connector puts in ``parallel_devices`` (from ``accelerator`` and ``devices``), whose every loader of
    every stage, the user's own too, starts its workers safely (``start_workers_safely``), as under ddp."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self._parallel_devices: list[torch.device] = []  # empty: Lightning's connector fills it from `devices`

    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices or [torch.device("cpu")]

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else torch.device("cpu")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return start_workers_safely(dataloader, self.global_rank)
