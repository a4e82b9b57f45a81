"""A data set's draws from the global streams keyed by the sample (docs/design-notes.md, data.draws)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import Dataset, Subset, get_worker_info
from typing_extensions import override

from dpddp.nn import _U64, key64, sample_states

log = logging.getLogger(__name__)

STREAMS = 0x5EED_DA7A  # folded into the seed first: these keys stay apart from dpddp.nn.sample_generator's


def sample_seeds(seed: int, epoch: int, ids: torch.Tensor) -> list[int]:
    """The 64-bit seed of each id (int64 ``[b]``): ``key64(key64(STREAMS, seed), epoch, id)``."""
    return [s & _U64 for s in sample_states(key64(STREAMS, seed), epoch, ids.reshape(-1)).tolist()]


def seed_streams(key: int) -> None:
    """Seed torch's CPU stream with ``key`` (64 bits), numpy's with its high 32 bits, Python's with ``key``."""
    torch.default_generator.manual_seed(key)
    np.random.seed(key >> 32)
    random.seed(key)


def get_streams() -> tuple:  # the three global streams' states, for set_streams
    return torch.default_generator.get_state(), np.random.get_state(), random.getstate()


def set_streams(state: tuple) -> None:
    torch.default_generator.set_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


@contextmanager
def streams_kept() -> Iterator[None]:
    """The global streams as they were before the block, after it (in a loader worker: nothing kept)."""
    if get_worker_info() is not None:
        yield
        return
    saved = get_streams()
    try:
        yield
    finally:
        set_streams(saved)


def fetch_keyed(dataset: Any, ids: Any, keys: list[int], getitems: Callable[[Any], Any] | None) -> Any:
    """``dataset[i]`` for each of ``ids`` seeded by its key, or ``getitems(ids)`` seeded by the first (0: no ids)."""
    with streams_kept():
        if getitems is not None:
            seed_streams(keys[0] if keys else 0)
            return getitems(ids)
        samples = []
        for i, key in zip(ids, keys, strict=True):
            seed_streams(key)
            samples.append(dataset[i])
        return samples


class EpochIds(list):  # a batch's sample ids with the training epoch their draws are keyed by
    def __init__(self, ids: list[int], epoch: int) -> None:
        super().__init__(ids)
        self.epoch = epoch


class KeyedSamples(Dataset):
    """``dataset`` for torch's loader: ``__getitems__(ids)`` keys each sample by ``(seed, epoch, id)`` (``EpochIds``'
    epoch, else 0), a batch by its first id where ``dataset`` has ``__getitems__``; ``rows``: ``(sample, id)``s."""

    def __init__(self, dataset: Any, seed: int = 0, rows: bool = False) -> None:
        self.dataset, self.seed, self.rows = dataset, seed, rows

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:  # unkeyed: a look at a sample outside the loader (draws_seen's probe)
        return self.dataset[i]

    def __getitems__(self, ids: list[int]) -> list[Any]:
        keys = sample_seeds(self.seed, getattr(ids, "epoch", 0), torch.tensor(ids, dtype=torch.long)) if ids else []
        getitems = None if self.rows else getattr(self.dataset, "__getitems__", None)
        if isinstance(self.dataset, Subset) and not callable(getattr(self.dataset.dataset, "__getitems__", None)):
            getitems = None  # torch's Subset has one that fetches its data set's samples one by one: key each
        samples = fetch_keyed(self.dataset, ids, keys, getitems)
        return list(zip(samples, ids, strict=True)) if self.rows else samples


class UnkeyedDraws(pl.Callback):
    """Warns once (rank 0) when torch's global stream moved between an epoch's first two training batches."""

    _after: tuple[int, int, torch.Tensor] | None = None
    _looked = False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._looked:
            self._after = trainer.current_epoch, args[-1], torch.default_generator.get_state()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._after is None:
            return
        (epoch, before, state), self._after, self._looked = self._after, None, True
        same_epoch = (trainer.current_epoch, batch_idx) == (epoch, before + 1)
        if same_epoch and trainer.is_global_zero and not torch.equal(state, torch.default_generator.get_state()):
            log.warning(
                "the training data drew from torch's global random stream between two steps where no keyed fetch "
                "serves it, so a continued run will not equal a straight one: serve it with data=dataset or "
                "data=sharded +data.module._target_=..., or draw from dpddp.nn.sample_generator(seed, epoch, index)"
            )
