"""The naive stock-Lightning peer of dpddp's job, for the benchmark (``bench/run.py``): the minimal program most
users would write with Lightning alone instead of dpddp (``stock_strong.py`` is what a knowledgeable user writes).

A ``LightningModule`` with one ``nn.Linear``, cross-entropy and SGD (lr 0.1, momentum 0.9) under automatic
optimization; a ``LightningDataModule`` over the project's tensors (``plain.load_splits``: the same
``[train | val | test]`` split of ``dpddp/data/synthetic.py``, loaded without the ``dpddp`` package) in
``TensorDataset``s with plain ``DataLoader``s (training shuffled, last partial batch dropped); a lean ``Trainer``
(no logger, checkpoints, progress bar, sanity validation or model summary); ``fit`` (validation after each
epoch), then ``test``. What differs from the project and ``plain.py`` is only what stock Lightning does on its
own: the sample order (the ``DataLoader``'s shuffle; under ddp Lightning's ``DistributedSampler``) and the
per-sample collate of the ``DataLoader``.

Modes:
    single: one process (``strategy="auto"``, one CPU).
    ddp: Lightning's own ``strategy="ddp"`` on ``world_size`` CPU processes (gloo), started by its subprocess
        launcher, which re-runs this command line for each other rank; each rank loads ``batch_size /
        world_size`` samples per step, so a step is still one global batch.

Writes (and prints) on global rank 0 a JSON object to ``out`` with the keys of ``plain.py``: ``samples_per_sec``
(steady state: global batches of the steps after the first of each epoch over the time from the end of that
first step to the end of the epoch's last step, samples/s), ``first_step_unix_s`` (``time.time()`` at the end of
the first optimizer step, s), ``wall_time_s`` (from ``main()`` to the end of testing, s), ``steps`` (optimizer
steps), ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc`` (mean loss per sample, fraction).

Usage: ``python bench/stock.py MODE WORLD_SIZE NUM_SAMPLES NUM_FEATURES NUM_CLASSES BATCH_SIZE EPOCHS OUT``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from plain import LR, MOMENTUM, SEED, load_splits  # bench/ is on sys.path: this script's own directory
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LinearModel(pl.LightningModule):
    """One ``nn.Linear``, cross-entropy, SGD: the user's model."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.linear(x), y)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self.linear(x)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}/acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class TensorDataModule(pl.LightningDataModule):
    """The project's tensors in ``TensorDataset``s; ``batch_size`` samples per process and step."""

    def __init__(self, num_samples: int, num_features: int, num_classes: int, batch_size: int) -> None:
        super().__init__()
        self.sizes, self.batch_size = (num_samples, num_features, num_classes), batch_size

    def setup(self, stage: str) -> None:
        self.splits = {name: TensorDataset(*tensors) for name, tensors in load_splits(*self.sizes).items()}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size)


class Timer(pl.Callback):
    """The measurements of ``plain.py``: steady-state samples/s (``global_batch`` samples per interval between
    consecutive step ends within an epoch; with one step per epoch, the step times alone) and the wall-clock time
    (``time.time()``, s) of the first step's end."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch, self.samples, self.seconds = global_batch, 0, 0.0
        self.first_step_unix_s: float | None = None
        self.fallback_s, self._last, self._begin = 0.0, None, 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_train_batch_start(self, *args: Any) -> None:
        self._begin = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        now = time.perf_counter()
        if self.first_step_unix_s is None:
            self.first_step_unix_s, self.fallback_s = time.time(), now - self._begin
        if self._last is not None:
            self.samples, self.seconds = self.samples + self.global_batch, self.seconds + now - self._last
        self._last = now

    @property
    def samples_per_sec(self) -> float:
        """Steady-state samples/s (``nan`` before any step)."""
        if self.samples:
            return self.samples / self.seconds
        return self.global_batch / self.fallback_s if self.fallback_s else float("nan")


Build = Callable[[argparse.Namespace], tuple[pl.LightningModule, pl.LightningDataModule, dict[str, Any]]]
"""The parsed command line -> the model, the data module and extra ``Trainer`` arguments."""


def run_peer(doc: str, build: Build, argv: list[str] | None = None) -> int:
    """The command line of a stock-Lightning peer (``doc``: its module docstring): seed, ``build`` the model
    and data, fit and test under a lean ``Trainer``, write the JSON on global rank 0; return the exit status."""
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("mode", choices=["single", "ddp"])
    parser.add_argument("world_size", type=int, help="processes (ddp); 1 for single")
    parser.add_argument("num_samples", type=int, help="samples in train + val + test")
    parser.add_argument("num_features", type=int)
    parser.add_argument("num_classes", type=int)
    parser.add_argument("batch_size", type=int, help="global batch (samples per optimizer step)")
    parser.add_argument("epochs", type=int)
    parser.add_argument("out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.batch_size % args.world_size:
        raise SystemExit(f"error: batch_size {args.batch_size} does not divide by world_size {args.world_size}")
    pl.seed_everything(SEED, verbose=False)
    model, data, extra = build(args)
    timer = Timer(args.batch_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy="ddp" if args.mode == "ddp" else "auto",
        max_epochs=args.epochs,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        **extra,
    )
    trainer.fit(model, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    metrics.update(trainer.test(model, datamodule=data, verbose=False)[0])
    if trainer.global_rank == 0:
        result = {
            "samples_per_sec": timer.samples_per_sec,
            "first_step_unix_s": timer.first_step_unix_s,
            "steps": trainer.global_step,
            **metrics,
            "mode": args.mode,
            "world_size": args.world_size,
            "wall_time_s": time.perf_counter() - start,
        }
        text = json.dumps(result, indent=2)
        args.out.write_text(text + "\n")
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, fit and test, write the JSON on global rank 0; return the exit status."""

    def build(args: argparse.Namespace) -> tuple[pl.LightningModule, pl.LightningDataModule, dict[str, Any]]:
        sizes = (args.num_samples, args.num_features, args.num_classes)
        per_device = args.batch_size // args.world_size
        return LinearModel(args.num_features, args.num_classes), TensorDataModule(*sizes, per_device), {}

    return run_peer(__doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())
