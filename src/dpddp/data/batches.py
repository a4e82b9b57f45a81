"""Data sets indexed by whole batches: ``ds[idx]``, ``idx`` int64 ``[b]`` or ``[k, b]``, is the whole batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from dpddp.data.draws import fetch_keyed, sample_seeds

DEFER_BYTES = 2**20  # an execution's rows of one tensor above this are gathered step by step (a core's L2 cache)


@dataclass(init=False)
class DeferredRows:
    """Rows ``ids`` (int64 ``[k, b]``) of ``source``: ``rows[i]`` gathers step ``i``'s rows (on ``device``)."""

    ids: torch.Tensor

    def __init__(self, ids: torch.Tensor, source: torch.Tensor, device: torch.device | None = None) -> None:
        self.ids, self.source, self.device = ids, source, device

    def to(self, device: Any, *args: Any, **kwargs: Any) -> DeferredRows:  # Lightning's batch transfer
        return DeferredRows(self.ids, self.source, torch.device(device))

    def __getitem__(self, i: int) -> torch.Tensor:
        rows = self.source.index_select(0, self.ids[i])
        return rows if self.device is None else rows.to(self.device, non_blocking=True)


def rows_of(tensor: torch.Tensor, idx: torch.Tensor, defer: bool) -> torch.Tensor | DeferredRows:
    """``tensor[idx]`` for int64 ``[b]`` or ``[k, b]`` ids; with ``defer``, big ``[k, b]`` rows as ``DeferredRows``."""
    if defer and idx.dim() > 1 and idx.numel() * math.prod(tensor.shape[1:]) * tensor.element_size() > DEFER_BYTES:
        return DeferredRows(idx, tensor)
    return tensor.index_select(0, idx.reshape(-1)).view(*idx.shape, *tensor.shape[1:])


def defer_rows(dataset: Any) -> bool:
    """Let ``dataset`` (a ``Batches``) give ``DeferredRows`` for ``[k, b]`` ids; returns whether it can."""
    if not isinstance(dataset, Batches):
        return False
    dataset.defer = True
    inner = dataset.dataset
    return isinstance(inner, TensorDataset) or defer_rows(inner)


def batch_indexable(dataset: Any) -> bool:
    """Whether ``dataset[idx]`` takes an int64 ids tensor: a ``TensorDataset``, or ``batch_indexable = True``."""
    return isinstance(dataset, TensorDataset) or bool(getattr(dataset, "batch_indexable", False))


def dataset_rows(dataset: Any, positions: torch.Tensor) -> torch.Tensor:
    """The whole data set's rows at ``positions`` of ``dataset``: its ``rows``, through a ``Subset``, else them."""
    rows = getattr(dataset, "rows", None)
    if callable(rows):
        return rows(positions)
    if isinstance(dataset, Subset):
        return dataset_rows(dataset.dataset, torch.as_tensor(dataset.indices, dtype=torch.long)[positions])
    return positions


def batch_inputs(batch: Any) -> Any:
    """The model's inputs in ``batch``: a tensor batch itself, a tuple or list's first element, else ``None``."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0]
    return None


def with_rows(batch: Any, rows: torch.Tensor) -> Any:
    """``batch`` followed by ``rows``: a dict's ``"index"``, a tuple's last element, else ``(batch, rows)``."""
    if isinstance(batch, dict):
        return {**batch, "index": rows}
    return (*batch, rows) if isinstance(batch, (tuple, list)) else (batch, rows)


def empty_batch(batch: Any) -> Any:
    return apply_to_collection(batch, torch.Tensor, lambda t: t[:0])


class Batches(Dataset):
    """``dataset`` by whole batches: ``view[idx]`` collates samples ``ids[idx]`` (``None``: all), ``[k, b]`` ids
    giving ``[k, b, ...]``; ``with_index``: their rows appended (``with_rows``). Draws keyed (``data.draws``)."""

    batch_indexable = True
    defer = False
    seed = 0
    epoch = 0

    def __init__(self, dataset: Any, ids: torch.Tensor | None = None, collate: Any = None, with_index: bool = False):
        self.dataset, self.ids, self.with_index = dataset, ids, with_index
        self.collate = collate or default_collate

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else len(self.dataset)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        return dataset_rows(self.dataset, positions if self.ids is None else self.ids[positions])

    def set_epoch(self, epoch: int) -> None:
        """Key the draws by ``epoch``; tell the data set's own ``set_epoch``."""
        self.epoch = epoch
        if callable(set_epoch := getattr(self.dataset, "set_epoch", None)):
            set_epoch(epoch)

    def _fetch(self, ids: torch.Tensor) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return tuple(rows_of(t, ids, self.defer) for t in self.dataset.tensors)
        if isinstance(self.dataset, Batches):
            return self.dataset[ids]
        if ids.dim() > 1 and (batch_indexable(self.dataset) or hasattr(self.dataset, "__getitems__")):
            return default_collate([self._fetch(row) for row in ids])  # each global batch keyed as with K=1
        if batch_indexable(self.dataset):
            first = sample_seeds(self.seed, self.epoch, ids.reshape(-1)[:1])
            return fetch_keyed(self.dataset, ids, first, self.dataset.__getitem__)
        if ids.dim() > 1:  # one fetch of all the execution's samples, then [k * b, ...] -> [k, b, ...]
            return apply_to_collection(
                self._fetch(ids.reshape(-1)), torch.Tensor, lambda t: t.view(*ids.shape, *t.shape[1:])
            )
        if not len(ids):
            return empty_batch(self._fetch(torch.zeros(1, dtype=torch.long)))
        keys, getitems = sample_seeds(self.seed, self.epoch, ids), getattr(self.dataset, "__getitems__", None)
        return self.collate(fetch_keyed(self.dataset, ids.tolist(), keys, getitems))

    def __getitem__(self, idx: torch.Tensor) -> Any:
        batch = self._fetch(idx if self.ids is None else self.ids[idx])
        return with_rows(batch, self.rows(idx)) if self.with_index else batch
