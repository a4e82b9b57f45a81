"""Models a user writes by subclassing the built-in MLP (``model=mlp model._target_=users_models.X``, with
``tests/`` on the import path): randomness from the global RNG, LR schedulers Lightning steps, BatchNorm; and a
data set with per-sample augmentation; a data module with its own loaders (``data=sharded``); an evaluation that
takes time."""

from __future__ import annotations

import random
import time

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset, random_split

from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.models.linear import LinearClassifier
from dpddp.models.mlp import MLPClassifier
from dpddp.nn import sample_generator


class GlobalDropoutMLP(MLPClassifier):
    """``torch.nn.Dropout`` (global RNG) before the output layer, and a ``torch.rand`` draw in every step."""

    def __init__(self, p: float = 0.3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[:-1](x)
        return self.net[-1](self.drop(hidden))

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = 0.01 * torch.rand_like(x)  # an augmentation drawn from the global RNG
        return super().training_step((x + noise, y), batch_idx)


class BatchCounter(pl.Callback):
    """A user's callback that breaks promise 3: it counts the training batches and sets the learning rate by the
    count (``lr / (1 + count / 10)``), but its ``state_dict`` holds only ``lr``, so a continued run counts from 0."""

    def __init__(self, lr: float = 0.05) -> None:
        self.lr, self.count = lr, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = self.lr / (1 + self.count / 10)
        self.count += 1

    def state_dict(self) -> dict:
        return {"lr": self.lr}

    def load_state_dict(self, state_dict: dict) -> None:
        self.lr = state_dict["lr"]


class PlateauMLP(MLPClassifier):
    """SGD with ``ReduceLROnPlateau`` on ``val/loss`` (``patience=0``: a step at most every epoch)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}


class StepLRMLP(MLPClassifier):
    """SGD with ``StepLR`` stepped every epoch."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


class BatchNormMLP(MLPClassifier):
    """``Linear -> BatchNorm1d -> ReLU`` in the first hidden layer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net.insert(1, nn.BatchNorm1d(self.hparams["hidden"][0]))


class NoisyBlobs(Dataset):
    """Gaussian blobs with augmentation: each sample's noise is drawn from ``sample_generator(seed, epoch, i)``,
    the epoch told by the data module (``set_epoch``)."""

    def __init__(self, num_samples: int = 600, num_features: int = 16, num_classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, num_classes, (num_samples,), generator=g)
        self.x = 2 * torch.randn(num_classes, num_features, generator=g)[self.y]
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(self.x.shape[1], generator=sample_generator(self.seed, self.epoch, int(i)))
        return self.x[i] + noise, self.y[i]


class AugBlobs(NoisyBlobs):
    """``NoisyBlobs`` whose augmentation draws from the global streams, as torchvision's transforms (torch) and
    others (numpy, Python's ``random``) do: ``x[i] + 0.5 * torch.randn(d) + 0.1 * np.random.randn(d)``, scaled by
    ``1 + 0.1 * random.random()``."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.x.shape[1]
        noise = 0.5 * torch.randn(d) + 0.1 * torch.from_numpy(np.random.randn(d)).float()
        return (self.x[i] + noise) * (1 + 0.1 * random.random()), self.y[i]


class AugBlobsBatched(AugBlobs):
    """``AugBlobs`` fetched by one ``__getitems__`` a batch."""

    def __getitems__(self, items: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self[i] for i in items]


class AugSplitData(pl.LightningDataModule):
    """A user's data module over ``AugBlobs`` (augmentation from the global streams) with its own loaders:
    ``Subset`` splits of 480, 60 and 60 samples, ``DataLoader(shuffle=True)`` for training, ``num_workers`` each."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str) -> None:
        data = AugBlobs()
        self.train, self.val, self.test = (Subset(data, range(a, b)) for a, b in ((0, 480), (480, 540), (540, 600)))

    def _loader(self, split: Dataset, shuffle: bool = False) -> DataLoader:
        return DataLoader(split, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test)


class RankOneBallastMLP(MLPClassifier):
    """Holds 1 GiB more on global rank 1 than anywhere else from the start of training (peak memory per rank)."""

    def on_train_start(self) -> None:
        if self.global_rank == 1:
            self.ballast = torch.ones(256 * 2**20)  # written: resident, not only reserved


class SplitData(pl.LightningDataModule):
    """A user's data module with its own loaders, as the README's way to bring one is usually written: ``Subset``
    splits of one data set, and a training ``DataLoader(shuffle=True)`` with a generator seeded once per fit."""

    def __init__(self, num_train: int = 101, batch_size: int = 12, num_features: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.num_train, self.batch_size, self.num_features, self.seed = num_train, batch_size, num_features, seed

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(self.seed)
        n = self.num_train + 30
        y = torch.randint(0, 3, (n,), generator=g)
        x = 2 * torch.randn(3, self.num_features, generator=g)[y] + torch.randn(n, self.num_features, generator=g)
        data = TensorDataset(x, y)
        self.train = Subset(data, range(self.num_train))
        self.val = Subset(data, range(self.num_train, self.num_train + 17))
        self.test = Subset(data, range(self.num_train + 17, n))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)


class PlainData(pl.LightningDataModule):
    """A plain LightningDataModule of a user's own, as Lightning's docs write one: its batch size is ``bs``, not
    ``batch_size``, and its training loader keeps the short last batch (``num_train=101`` in batches of 12)."""

    def __init__(self, num_train: int = 101, bs: int = 12, num_features: int = 4) -> None:
        super().__init__()
        self.split = SplitData(num_train=num_train, batch_size=bs, num_features=num_features)
        self.bs = bs

    def setup(self, stage: str) -> None:
        self.split.setup(stage)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.split.train, batch_size=self.bs, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.split.val, batch_size=self.bs)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.split.test, batch_size=self.bs)


class WorkerData(SplitData):
    """``SplitData`` with ``num_workers`` DataLoader worker processes in every loader (``persistent_workers`` as
    given), as users write it; ``hang=True``: each worker's first item blocks for an hour (a stuck worker), with
    the loaders' own ``timeout`` seconds; ``lambda_transform=True``: every split's items pass through a lambda (a
    data set a fork server cannot get)."""

    def __init__(self, num_workers: int = 2, persistent_workers: bool = True, hang: bool = False, timeout: float = 0,
                 lambda_transform: bool = False, **kwargs) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.workers = {"num_workers": num_workers, "persistent_workers": persistent_workers, "timeout": timeout}
        self.hang, self.lambda_transform = hang, lambda_transform

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.hang:
            self.train = Subset(_HangInWorker(self.train.dataset), self.train.indices)
        if self.lambda_transform:
            self.train, self.val, self.test = (_Mapped(s, lambda item: item) for s in (self.train, self.val, self.test))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=generator, **self.workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, **self.workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size, **self.workers)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


def open_shard(worker_id: int) -> None:
    """A user's ``worker_init_fn`` that cannot open its worker's shard."""
    raise FileNotFoundError(f"shard-{worker_id}.bin: no such file")


class _Mapped(Dataset):
    """``dataset``'s items through ``fn``."""

    def __init__(self, dataset, fn) -> None:
        self.dataset, self.fn = dataset, fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.fn(self.dataset[i])


class _HangInWorker(Dataset):
    """``dataset``, whose items block for an hour in a DataLoader worker process (not in the main process)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(3600)
        return self.dataset[i]


class MemoryBoundMLP(MLPClassifier):
    """Runs out of memory as a GPU would: a training forward of more than ``limits[global rank]`` samples raises
    ``torch.OutOfMemoryError`` (the last limit serves the ranks after it). ``biggest``: the largest training
    forward that ran."""

    def __init__(self, limits: tuple[int, ...] | list[int] = (1 << 30,), **kwargs) -> None:
        super().__init__(**kwargs)
        self.limits, self.biggest = list(limits), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            limit = self.limits[min(self.global_rank, len(self.limits) - 1)]
            if len(x) > limit:
                raise torch.OutOfMemoryError(f"out of memory: {len(x)} samples on rank {self.global_rank}")
            self.biggest = max(self.biggest, len(x))
        return super().forward(x)


class SlowEvalMLP(MLPClassifier):
    """Sleeps ``eval_sleep_s`` seconds in every validation, test and predict step (an evaluation that takes time, so
    a signal can land in it); its training and outputs are the MLP's."""

    def __init__(self, eval_sleep_s: float = 0.05, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eval_sleep_s = eval_sleep_s

    def validation_step(self, batch, batch_idx):
        time.sleep(self.eval_sleep_s)
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        time.sleep(self.eval_sleep_s)
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        time.sleep(self.eval_sleep_s)
        return super().predict_step(batch, batch_idx)


class ScriptedScoreMLP(MLPClassifier):
    """Logs ``val/score`` at each validation's end from ``scores`` by epoch (the last one after them): an
    EarlyStopping monitor whose course a test chooses."""

    def __init__(self, scores: tuple[float, ...] | list[float] = (1.0, 2.0, 0.5, 0.4), **kwargs) -> None:
        super().__init__(**kwargs)
        self.scores = list(scores)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.log("val/score", self.scores[min(self.current_epoch, len(self.scores) - 1)])


class CosineMLP(MLPClassifier):
    """SGD with ``CosineAnnealingLR(T_max=trainer.max_epochs)``: a schedule built for the run's epoch limit."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        assert self.trainer.max_epochs is not None
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.trainer.max_epochs),
        }


class OneCycleMLP(MLPClassifier):
    """SGD with ``OneCycleLR(total_steps=trainer.estimated_stepping_batches)`` stepped every step."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RankOneDrifts(LinearClassifier):
    """Test model: after optimizer step ``at_step``, on global rank 1 only, adds 1e-3 to one weight of
    ``linear.weight`` (a fault on that rank's device)."""

    def __init__(self, at_step: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_step = at_step

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_rank == 1 and self.trainer.global_step == self.at_step:
            with torch.no_grad():
                self.linear.weight[0, 0] += 1e-3


class BackboneMLP(MLPClassifier):
    """The MLP with its hidden layers as ``backbone`` (for ``BackboneFinetuning``), whose optimizer holds the
    trainable parameters only: the callback adds the backbone's as a group of its own when it unfreezes them."""

    @property
    def backbone(self) -> nn.Module:
        return self.net[:-1]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.Adam(trainable, lr=self.hparams["lr"])


class KeptBatchCounter(BatchCounter):
    """``BatchCounter`` whose ``state_dict`` holds its count too: a continued run goes on counting (promise 3)."""

    def state_dict(self) -> dict:
        return {"lr": self.lr, "count": self.count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.lr, self.count = state_dict["lr"], state_dict["count"]


class GlobalStreamData(GlobalBatchDataModule):
    """Data built in code as tutorials write it, from the global streams with no generator: ``torch.randn``,
    ``np.random`` and ``torch.utils.data.random_split`` without a generator (issue 52, case 66's kind)."""

    def make_dataset(self) -> Dataset:
        n, d, c = 301, 16, 4
        y = torch.randint(0, c, (n,))
        x = 2 * torch.randn(c, d)[y] + torch.from_numpy(np.random.randn(n, d).astype(np.float32))
        return TensorDataset(x, y)

    def make_splits(self) -> dict[str, Dataset]:
        train, val, test = random_split(self.make_dataset(), [0.8, 0.1, 0.1])
        return {"train": train, "val": val, "test": test}


class StreamBlobs(IterableDataset):
    """Samples streamed one by one (an ``IterableDataset``: no ``__len__`` or ``__getitem__``; case 62)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(64):
            yield torch.randn(4, generator=g), torch.randint(0, 3, (), generator=g)


class ShuffledStream(IterableDataset):
    """A stream that shuffles each pass with ``torch.randperm`` from the global stream (no generator), as a
    shuffle buffer does: ``num_samples`` blobs of ``num_features`` features, 3 classes (``data=stream``)."""

    def __init__(self, num_samples: int = 400, num_features: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 3, (num_samples,), generator=g)
        self.x = 2 * torch.randn(3, num_features, generator=g)[self.y] + torch.randn(
            num_samples, num_features, generator=g
        )

    def __iter__(self):
        for i in torch.randperm(len(self.y)).tolist():
            yield self.x[i], self.y[i]
