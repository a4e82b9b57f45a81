"""Each training batch's keys of per-sample randomness (``dpddp.nn``), from the ids its sampler yielded."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from dpddp.data.global_batch import YieldedIds
from dpddp.errors import ConfigError
from dpddp.nn import SampleDropout, assign_layer_keys, clear_sample_keys, set_sample_keys
from dpddp.parallel.dp import DataParallelStrategy


def uses_sample_keys(model: nn.Module) -> bool:
    return bool(getattr(model, "uses_sample_keys", False)) or any(isinstance(m, SampleDropout) for m in model.modules())


def _sampler(trainer: pl.Trainer) -> YieldedIds | None:
    """The training loader's ``YieldedIds`` (its sampler, batch sampler or data set), else ``None``."""
    loader = trainer.train_dataloader  # a stream's shares are the data set
    places: tuple[object, ...] = (
        (loader.sampler, loader.batch_sampler, loader.dataset) if isinstance(loader, DataLoader) else ()
    )
    return next((p for p in places if isinstance(p, YieldedIds)), None)


class SampleKeyCallback(pl.Callback):
    """Keys the layers at the fit's start and each training batch by ``(seed, epoch, ids at batch_idx)``. Raises
    ConfigError: training data served by no ``YieldedIds``; RuntimeError: no ids recorded for a batch."""

    devices: list[int] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assign_layer_keys(pl_module)
        strategy = trainer.strategy
        parallel = strategy.parallel_devices if isinstance(strategy, DataParallelStrategy) else []
        self.devices = [d.index for d in parallel if d.type == "cuda"] if len(parallel) > 1 else None
        if uses_sample_keys(pl_module) and _sampler(trainer) is None:  # a SampleDropout, or said
            raise ConfigError(
                f"model: {type(pl_module).__name__}'s SampleDropout (per-sample randomness) has no sample keys from "
                "loaders dpddp does not serve: serve it with data=dataset or data=sharded +data.module._target_=..., "
                "or use nn.Dropout"
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        sampler = _sampler(trainer)
        if sampler is None:
            return
        found = sampler.ids_at(batch_idx)
        if found is None:
            raise RuntimeError(
                f"no sample ids recorded for training batch {batch_idx} of epoch {trainer.current_epoch}: the "
                "global-batch sampler and Lightning's batch count disagree"
            )
        epoch, ids = found
        set_sample_keys(sampler.seed, epoch, ids, self.devices)

    def _clear(self, *args: Any, **kwargs: Any) -> None:
        clear_sample_keys()

    on_train_batch_end = on_train_end = on_exception = _clear
