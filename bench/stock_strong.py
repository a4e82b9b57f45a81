"""The strongest stock-Lightning peer of dpddp's job, for the benchmark (``bench/run.py``): what a user who knows
Lightning and PyTorch's data loading writes with Lightning alone.

The model of ``stock.py`` (one ``nn.Linear``, cross-entropy, SGD lr 0.1 momentum 0.9, automatic optimization,
``seed_everything(0)``), over the project's tensors (``plain.load_splits``), with what ``stock.py`` lacks:

- batches, not samples: the ``DataLoader`` gets a sampler that yields each step's ids as one int64 tensor and
  ``batch_size=None``, so torch's fetcher calls ``dataset[ids]`` once per step (``_MapDatasetFetcher`` without
  auto-collation), and the dataset answers with one ``index_select`` per tensor; no per-sample collate, no
  ``__getitems__`` list of ids to convert;
- the order and the global batch of ``plain.py``: the ids of rank ``r`` are the contiguous ``r``-th
  ``batch_size / world_size`` of each global batch of the project's seeded permutation (``plain.rank_batches``),
  so under Lightning's own ``ddp`` a step is still one global batch, and ``use_distributed_sampler=False`` keeps
  Lightning from wrapping the sampler in a ``DistributedSamplerWrapper`` (which would deal whole batches out to
  the ranks, shuffled); validation and test take each rank's contiguous part of the split, like ``plain.py``;
- a lean ``Trainer``: no logger, checkpointing, progress bar, model summary or sanity validation, nothing logged
  during training; evaluation sums loss and hits per batch and logs once per epoch, reduced over the ranks by
  the strategy (``Strategy.reduce``). ``barebones=True`` sets the same switches and forbids ``self.log``.

It does the job of ``plain.py`` (the same samples in the same steps), so its ``test/loss`` equals plain's up to
float rounding. Modes, arguments and the JSON written are ``stock.py``'s.

Usage: ``python bench/stock_strong.py MODE WORLD_SIZE NUM_SAMPLES NUM_FEATURES NUM_CLASSES BATCH_SIZE EPOCHS OUT``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from plain import LR, MOMENTUM, Split, epoch_order, load_splits, rank_batches  # bench/ is on sys.path
from stock import run_peer
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler


class Rows(Dataset):
    """Tensors indexed by a whole batch: ``rows[ids]`` (int64 ``[b]``) is ``(x[ids], y[ids])`` by one
    ``index_select`` each."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.index_select(0, ids) for t in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors[0])


class TrainBatches(Sampler[torch.Tensor]):
    """Each step's ids of this rank, as ``plain.py`` takes them: ``plain.rank_batches`` of the epoch's seeded
    permutation (``set_epoch`` is Lightning's hook for a sampler's epoch)."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int) -> None:
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = epoch_order(self.num_samples, self.epoch)
        return iter(rank_batches(order, self.batch_size, self.rank, self.world_size))

    def __len__(self) -> int:
        return self.num_samples // self.batch_size


def _identity(batch: Any) -> Any:
    """The batch as the dataset returned it (already tensors)."""
    return batch


class LinearModel(pl.LightningModule):
    """One ``nn.Linear``, cross-entropy, SGD; evaluation metrics as per-sample means over all ranks."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)
        self.sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count of the running evaluation

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.linear(x), y)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        logits = self.linear(x)
        loss = F.cross_entropy(logits, y, reduction="sum")
        self.sums += torch.tensor([loss, (logits.argmax(1) == y).sum(), len(y)], dtype=torch.float64)

    def _log_epoch(self, stage: str) -> None:
        loss, correct, count = self.trainer.strategy.reduce(self.sums, reduce_op="sum").tolist()
        self.log_dict({f"{stage}/loss": loss / max(count, 1), f"{stage}/acc": correct / max(count, 1)})
        self.sums.zero_()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class BatchDataModule(pl.LightningDataModule):
    """The project's tensors served a batch per fetch; ``batch_size`` is the global batch."""

    def __init__(self, num_samples: int, num_features: int, num_classes: int, batch_size: int) -> None:
        super().__init__()
        self.sizes, self.batch_size = (num_samples, num_features, num_classes), batch_size

    def setup(self, stage: str) -> None:
        self.splits: dict[str, Split] = load_splits(*self.sizes)

    def _ranks(self) -> tuple[int, int]:
        return self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self) -> DataLoader:
        x, y = self.splits["train"]
        sampler = TrainBatches(len(y), self.batch_size, *self._ranks())
        return DataLoader(Rows(x, y), sampler=sampler, batch_size=None, collate_fn=_identity)

    def _eval_loader(self, split: str) -> DataLoader:
        rank, world_size = self._ranks()
        x, y = (t.tensor_split(world_size)[rank] for t in self.splits[split])
        chunk = self.batch_size // world_size
        return DataLoader(
            Rows(x, y), sampler=list(torch.arange(len(y)).split(chunk)), batch_size=None, collate_fn=_identity
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, fit and test, write the JSON on global rank 0; return the exit status."""

    def build(args: argparse.Namespace) -> tuple[pl.LightningModule, pl.LightningDataModule, dict[str, Any]]:
        data = BatchDataModule(args.num_samples, args.num_features, args.num_classes, args.batch_size)
        return LinearModel(args.num_features, args.num_classes), data, {"use_distributed_sampler": False}

    return run_peer(__doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())
