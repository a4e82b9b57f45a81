"""Data sets indexed by whole batches: ``ds[idx]`` with ``idx`` an int64 tensor of ids (``[b]``, or ``[k, b]`` for the
``k`` steps of one execution) returns the whole batch in one call, with no per-sample collate where the data
allows. ``GlobalBatchDataModule`` (``dpddp.data.global_batch``) serves its splits through them."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

__all__ = ["Batches", "TensorBatches", "batch_indexable", "batch_inputs", "dataset_rows", "empty_batch", "gather"]


def gather(tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``tensor`` (int64 ``[b]`` or ``[k, b]``), as ``tensor[idx]`` gives them: ``index_select``
    on the flattened ids, faster than advanced indexing on CPU, and contiguous."""
    if idx.dim() == 1:  # one step's batch: no reshape and view (microseconds a step on tiny batches)
        return tensor.index_select(0, idx)
    rows = tensor.index_select(0, idx.reshape(-1))
    return rows.view(*idx.shape, *tensor.shape[1:])


def batch_indexable(dataset: Any) -> bool:
    """Whether ``dataset[idx]`` with ``idx`` an int64 ``[b]`` (or ``[k, b]``) tensor returns the whole batch in
    one index (a ``TensorDataset``, or a class with ``batch_indexable = True``), with no per-sample collate."""
    return isinstance(dataset, TensorDataset) or bool(getattr(dataset, "batch_indexable", False))


def dataset_rows(dataset: Any, positions: torch.Tensor) -> torch.Tensor:
    """The rows of the whole data set that ``positions`` (int64 ``[b]``) of ``dataset`` hold: ``dataset.rows``
    where it has one (a split of ``Batches``, ``TensorBatches`` or ``StreamingTensors``), through a torch
    ``Subset``'s ``indices``, else the positions themselves (``dataset`` is the whole data set)."""
    rows = getattr(dataset, "rows", None)
    if callable(rows):
        return rows(positions)
    if isinstance(dataset, Subset):
        return dataset_rows(dataset.dataset, torch.as_tensor(dataset.indices, dtype=torch.long)[positions])
    return positions


def batch_inputs(batch: Any) -> Any:
    """The model's inputs in ``batch`` by the rule of dpddp's data modules: a batch is what the samples collate
    to, and a tuple or list batch is ``(inputs, target, ...)``, so its first element; a tensor batch is the
    inputs itself. ``None`` for a dict (or any other) batch, whose inputs only the model's own
    ``predict_step`` knows."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0]
    return None


class TensorBatches(Dataset):
    """A dataset indexed by whole batches: ``ds[idx]`` with ``idx`` an int64 ``[b]`` tensor returns
    ``(x[idx], y[idx])`` in one gather (``gather``), shapes ``[b, num_features]`` and ``[b]`` (no per-sample
    collate; an ``idx`` of ``[k, b]`` gives ``[k, b, num_features]`` and ``[k, b]``); with ``with_index=True``
    also ``idx`` itself (for predictions in dataset order). ``first_row``: the row of the whole data set that
    position 0 holds (a contiguous split), for ``rows``."""

    batch_indexable = True

    def __init__(self, x: torch.Tensor, y: torch.Tensor, with_index: bool = False, first_row: int = 0) -> None:
        self.x, self.y, self.with_index, self.first_row = x, y, with_index, first_row

    def __len__(self) -> int:
        return len(self.y)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The whole data set's rows at ``positions`` of this split."""
        return positions + self.first_row

    def __getitem__(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, y = gather(self.x, idx), gather(self.y, idx)
        return (x, y, idx) if self.with_index else (x, y)


def empty_batch(batch: Any) -> Any:
    """``batch`` with every tensor cut to 0 rows (tuples, lists and dicts followed)."""
    return apply_to_collection(batch, torch.Tensor, lambda t: t[:0])


class Batches(Dataset):
    """Any map-style data set, indexed by whole batches: ``view[idx]`` (int64 ``[b]`` positions in this view)
    is the batch of samples ``ids[idx]`` of ``dataset`` (all of it when ``ids`` is ``None``), fetched in one index
    (``batch_indexable``), one ``__getitems__`` call, or one ``dataset[i]`` per sample collated by ``collate``.
    An ``idx`` of ``[k, b]`` gives every tensor a leading ``[k, b]``; an empty one, 0 rows of a real batch's
    structure. ``with_index=True`` appends the data set's own rows of the batch (``rows``; an ``"index"`` key
    for a dict batch)."""

    batch_indexable = True

    def __init__(self, dataset: Any, ids: torch.Tensor | None = None, collate: Any = None, with_index: bool = False):
        self.dataset, self.ids, self.with_index = dataset, ids, with_index
        self.collate = collate or default_collate

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else len(self.dataset)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of the whole data set (``dataset_rows`` of ``dataset``) at ``positions`` of this view."""
        return dataset_rows(self.dataset, positions if self.ids is None else self.ids[positions])

    def _fetch(self, ids: torch.Tensor) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return tuple(gather(t, ids) for t in self.dataset.tensors)
        if batch_indexable(self.dataset):
            return self.dataset[ids]
        if ids.dim() > 1:  # one fetch of all the execution's samples, then [k * b, ...] -> [k, b, ...]
            return apply_to_collection(
                self._fetch(ids.reshape(-1)), torch.Tensor, lambda t: t.view(*ids.shape, *t.shape[1:])
            )
        if not len(ids):
            return empty_batch(self._fetch(torch.zeros(1, dtype=torch.long)))
        items = ids.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(items) if getitems is not None else [self.dataset[i] for i in items]
        return self.collate(samples)

    def __getitem__(self, idx: torch.Tensor) -> Any:
        batch = self._fetch(idx if self.ids is None else self.ids[idx])
        if not self.with_index:
            return batch
        rows = self.rows(idx)
        return {**batch, "index": rows} if isinstance(batch, dict) else (*batch, rows)
