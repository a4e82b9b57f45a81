"""One process: ``strategy=auto`` on one device, and ``dp`` (``nn.DataParallel``), which Lightning 2.x removed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from torch import nn
from typing_extensions import override


class _Forward(nn.Module):
    """Runs the class's forward on each replica's copy of ``module`` (bypassing the instance-level patch)."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


def replicate_forward(module: pl.LightningModule, device_ids: list[int]) -> nn.DataParallel:
    """Route ``module(x)`` through ``nn.DataParallel`` over ``device_ids`` (no submodule) until ``restore_forward``."""
    replicated = nn.DataParallel(_Forward(module), device_ids=device_ids)  # outputs on the first
    module.__dict__["forward"] = replicated.__call__  # nn.Module.__call__ looks up self.forward
    return replicated


def restore_forward(module: pl.LightningModule) -> None:
    """Undo ``replicate_forward``; a ``forward`` the model set on itself stays."""
    if isinstance(getattr(module.__dict__.get("forward"), "__self__", None), nn.DataParallel):
        del module.__dict__["forward"]


class OneProcessStrategy(SingleDeviceStrategy):
    """Lightning's single-device strategy on the first of its ``parallel_devices``; ``start_workers(loader, rank)``."""

    def __init__(self, start_workers: Callable[[Any, int], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self._parallel_devices: list[torch.device] = []  # empty: Lightning's connector fills it from `devices`
        self._start_workers = start_workers

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return dataloader if self._start_workers is None else self._start_workers(dataloader, self.global_rank)

    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = self.check_devices(devices or [torch.device("cpu")])

    def check_devices(self, devices: list[torch.device]) -> list[torch.device]:
        """``devices``. Raises ``ValueError`` when this strategy cannot run on them."""
        return devices

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else torch.device("cpu")


class DataParallelStrategy(OneProcessStrategy):
    """``torch.nn.DataParallel`` over several GPUs; checkpoints hold the plain module's weights. Raises ``ValueError``
    at Trainer construction for more than one CPU device."""

    strategy_name = "dp"

    @override
    def check_devices(self, devices: list[torch.device]) -> list[torch.device]:
        if len(devices) > 1 and devices[0].type != "cuda":
            given = f"strategy=dp with devices={len(devices)} on {devices[0].type}"
            fix = f"for several CPU processes use strategy=ddp devices={len(devices)}"
            raise ValueError(f"{given}: DataParallel replicates over CUDA GPUs in one process; {fix}")
        return devices

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        if len(self._parallel_devices) > 1 and module is not None:
            replicate_forward(module, [d.index for d in self._parallel_devices])

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            restore_forward(self.lightning_module)
        super().teardown()


StrategyRegistry.register(
    "dp", DataParallelStrategy, description="DataParallel: one process, forward replicated over GPUs", override=True
)
