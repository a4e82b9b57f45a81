"""Each training batch's keys of per-sample randomness (``dpddp.nn``), from the ids its sampler yielded:
``sample_key_callbacks(model)`` is what a run adds to its Trainer."""

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

__all__ = ["SampleKeyCallback", "sample_key_callbacks", "uses_sample_keys"]


def uses_sample_keys(model: nn.Module) -> bool:
    """Whether ``model`` has a ``SampleDropout`` or sets ``uses_sample_keys = True`` (its own keyed draws)."""
    return bool(getattr(model, "uses_sample_keys", False)) or any(isinstance(m, SampleDropout) for m in model.modules())


def sample_key_callbacks(model: nn.Module) -> list[pl.Callback]:
    """``[SampleKeyCallback()]`` for a model that uses sample keys, else ``[]`` (no per-batch hooks)."""
    return [SampleKeyCallback()] if uses_sample_keys(model) else []


def _sampler(trainer: pl.Trainer) -> YieldedIds | None:
    """The training loader's sampler, batch sampler or data set that records its ids (dpddp's: ``data=dataset``,
    ``data=sharded`` or ``data=stream``), else ``None``."""
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return None
    for sampler in (loader.sampler, loader.batch_sampler, loader.dataset):  # a stream's shares: the data set
        if isinstance(sampler, YieldedIds):
            return sampler
    return None


class SampleKeyCallback(pl.Callback):
    """At ``on_train_batch_start``, keys ``(data seed, epoch, ids)`` of the batch the ``GlobalBatchSampler``
    recorded at ``batch_idx`` (``[k, b]`` ids for an execution; DataParallel's device ids under ``dp``);
    cleared at its end. ``on_train_start`` keys the layers (``assign_layer_keys``).

    Raises:
        ConfigError: at ``on_train_start``, training data served by no sampler of dpddp's (``YieldedIds``: a data
            module's own loaders outside ``data=sharded``), which gives no keys.
        RuntimeError: no ids recorded for a batch's ``batch_idx``.
    """

    def __init__(self) -> None:
        self.devices: list[int] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = assign_layer_keys(pl_module)
        strategy = trainer.strategy
        parallel = strategy.parallel_devices if isinstance(strategy, DataParallelStrategy) else []
        self.devices = [d.index for d in parallel if d.type == "cuda"] if len(parallel) > 1 else None
        if (layers or uses_sample_keys(pl_module)) and _sampler(trainer) is None:
            raise ConfigError(
                f"model: {type(pl_module).__name__}'s SampleDropout (per-sample randomness) has no sample keys: the "
                "training data comes from loaders dpddp does not serve, so it would be a plain nn.Dropout: serve the "
                "data with data=dataset or data=sharded +data.module._target_=..., or use nn.Dropout"
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

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clear_sample_keys()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clear_sample_keys()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        clear_sample_keys()
