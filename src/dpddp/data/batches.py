"""Data sets indexed by whole batches: ``ds[idx]`` with ``idx`` an int64 tensor of ids (``[b]``, or ``[k, b]`` for the
``k`` steps of one execution) returns the whole batch in one call, with no per-sample collate where the data
allows. ``GlobalBatchDataModule`` (``dpddp.data.global_batch``) serves its splits through them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from dpddp.data.draws import sample_seeds, seed_streams, streams_kept

__all__ = ["Batches", "TensorBatches", "batch_indexable", "batch_inputs", "dataset_rows", "empty_batch", "gather"]
__all__ += ["DEFER_BYTES", "DeferredRows", "defer_rows", "rows_of"]

DEFER_BYTES = 2**20
"""An execution's rows of one tensor above this many bytes are gathered step by step (``DeferredRows``): about a
core's L2 cache, which the whole ``[k, b, ...]`` would leave."""


def gather(tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``tensor`` (int64 ``[b]`` or ``[k, b]``), as ``tensor[idx]`` gives them: ``index_select``
    on the flattened ids, faster than advanced indexing on CPU, and contiguous."""
    if idx.dim() == 1:  # one step's batch: no reshape and view (microseconds a step on tiny batches)
        return tensor.index_select(0, idx)
    rows = tensor.index_select(0, idx.reshape(-1))
    return rows.view(*idx.shape, *tensor.shape[1:])


@dataclass(init=False)
class DeferredRows:
    """The rows ``ids`` (int64 ``[k, b]``) of ``source`` (``[n, ...]``) for the ``k`` steps of one execution, not
    gathered yet: ``rows[i]`` gathers step ``i``'s ``[b, ...]`` (on ``device``) as the step runs, so each step reads
    rows it has just written (in cache) rather than a ``[k, b, ...]`` written out beforehand. Lightning's batch
    transfer calls ``to``; its batch-size inference reads the one field, ``ids``: ``k``, as from gathered rows."""

    ids: torch.Tensor

    def __init__(self, ids: torch.Tensor, source: torch.Tensor, device: torch.device | None = None) -> None:
        self.ids, self.source, self.device = ids, source, device

    def to(self, device: Any, *args: Any, **kwargs: Any) -> DeferredRows:
        """The same rows, to be gathered onto ``device``."""
        return DeferredRows(self.ids, self.source, torch.device(device))

    def __getitem__(self, i: int) -> torch.Tensor:
        rows = self.source.index_select(0, self.ids[i])
        return rows if self.device is None else rows.to(self.device, non_blocking=True)


def rows_of(tensor: torch.Tensor, idx: torch.Tensor, defer: bool) -> torch.Tensor | DeferredRows:
    """``gather(tensor, idx)``; with ``defer``, an ``idx`` of ``[k, b]`` whose rows take more than ``DEFER_BYTES``
    gives ``DeferredRows`` instead."""
    if defer and idx.dim() == 2 and idx.numel() * math.prod(tensor.shape[1:]) * tensor.element_size() > DEFER_BYTES:
        return DeferredRows(idx, tensor)
    return gather(tensor, idx)


def defer_rows(dataset: Any) -> bool:
    """Let ``dataset`` (a ``TensorBatches``, or a ``Batches`` and the ``Batches`` or ``TensorBatches`` it wraps) give
    ``DeferredRows`` for ``[k, b]`` ids; whether it can (another data set gathers every row itself)."""
    if isinstance(dataset, Batches):
        dataset.defer = True
        inner = dataset.dataset
        return isinstance(inner, TensorDataset) or (batch_indexable(inner) and defer_rows(inner))
    if isinstance(dataset, TensorBatches):
        dataset.defer = True
        return True
    return False


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
    position 0 holds (a contiguous split), for ``rows``. ``defer``: ``[k, b]`` ids may give ``DeferredRows``
    (``rows_of``)."""

    batch_indexable = True
    defer = False

    def __init__(self, x: torch.Tensor, y: torch.Tensor, with_index: bool = False, first_row: int = 0) -> None:
        self.x, self.y, self.with_index, self.first_row = x, y, with_index, first_row

    def __len__(self) -> int:
        return len(self.y)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The whole data set's rows at ``positions`` of this split."""
        return positions + self.first_row

    def __getitem__(self, idx: torch.Tensor) -> tuple[torch.Tensor | DeferredRows, ...]:
        x, y = rows_of(self.x, idx, self.defer), rows_of(self.y, idx, self.defer)
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
    for a dict batch). ``defer``: a ``TensorDataset``'s (or a batch-indexable data set's) ``[k, b]`` rows may be
    ``DeferredRows`` (``rows_of``). A data set's own code runs with the global random streams keyed by ``(seed,
    epoch, id)`` for each sample it fetches (by its first id for one ``__getitems__`` or batch index: one a global
    batch, so ``[k, b]`` fetches what ``k`` fetches of ``[b]`` would) and kept
    as they were around it (``dpddp.data.draws``); ``set_epoch`` sets ``epoch`` and tells the data set's own."""

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
        """The rows of the whole data set (``dataset_rows`` of ``dataset``) at ``positions`` of this view."""
        return dataset_rows(self.dataset, positions if self.ids is None else self.ids[positions])

    def set_epoch(self, epoch: int) -> None:
        """Key the samples' draws by ``epoch`` and call the data set's own ``set_epoch``, if it has one."""
        self.epoch = epoch
        if callable(set_epoch := getattr(self.dataset, "set_epoch", None)):
            set_epoch(epoch)

    def _fetch(self, ids: torch.Tensor) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return tuple(rows_of(t, ids, self.defer) for t in self.dataset.tensors)
        if isinstance(self.dataset, (Batches, TensorBatches)):
            return self.dataset[ids]
        if ids.dim() > 1 and (batch_indexable(self.dataset) or hasattr(self.dataset, "__getitems__")):
            return default_collate([self._fetch(row) for row in ids])  # each global batch keyed as with K=1
        if batch_indexable(self.dataset):
            with streams_kept():
                seed_streams(sample_seeds(self.seed, self.epoch, ids.reshape(-1)[:1])[0] if ids.numel() else 0)
                return self.dataset[ids]
        if ids.dim() > 1:  # one fetch of all the execution's samples, then [k * b, ...] -> [k, b, ...]
            return apply_to_collection(
                self._fetch(ids.reshape(-1)), torch.Tensor, lambda t: t.view(*ids.shape, *t.shape[1:])
            )
        if not len(ids):
            return empty_batch(self._fetch(torch.zeros(1, dtype=torch.long)))
        items, keys = ids.tolist(), sample_seeds(self.seed, self.epoch, ids)
        getitems = getattr(self.dataset, "__getitems__", None)
        with streams_kept():
            if getitems is not None:
                seed_streams(keys[0])
                samples = getitems(items)
            else:
                samples = []
                for i, key in zip(items, keys, strict=True):
                    seed_streams(key)
                    samples.append(self.dataset[i])
        return self.collate(samples)

    def __getitem__(self, idx: torch.Tensor) -> Any:
        batch = self._fetch(idx if self.ids is None else self.ids[idx])
        if not self.with_index:
            return batch
        rows = self.rows(idx)
        return {**batch, "index": rows} if isinstance(batch, dict) else (*batch, rows)
