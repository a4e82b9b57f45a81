"""Any map-style data set in global batches (GlobalBatchDataModule), a user's own loaders sharded or refused
(a user's loader never silently duplicated on every rank), the bundled tables, and the metric contract."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import compose_cfg
from omegaconf import open_dict
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dpddp.data.global_batch import Batches, GlobalBatchDataModule, GlobalBatchSampler
from dpddp.data.sharded import ShardedDataModule, shard_loader
from dpddp.data.tables import TableDataModule
from dpddp.errors import ConfigError
from dpddp.models.mlp import MLPClassifier
from dpddp.report.contract import MetricContract
from dpddp.report.tally import FitTally
from dpddp.run.config import check_config
from dpddp.run.draws_seen import find_draws


class PerSample(Dataset):
    """A plain map-style data set: one sample per ``__getitem__``, dict samples."""

    def __init__(self, n: int) -> None:
        self.x = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": torch.tensor(i % 2)}


class Batched(PerSample):
    """The same with torch's batched fetch."""

    calls = 0

    def __getitems__(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        Batched.calls += 1
        return [self[i] for i in ids]


class _Trainer:
    def __init__(self, rank: int, world_size: int) -> None:
        self.global_rank, self.world_size = rank, world_size
        self.current_epoch, self.num_training_batches = 1, 0  # dpddp._compat.data_position: epoch 1, no skip


def _batches(dm: GlobalBatchDataModule, split: str, world: int) -> list[list]:
    out = []
    for rank in range(world):
        dm.trainer = _Trainer(rank, world)  # type: ignore[assignment]
        loader = getattr(dm, f"{split}_dataloader")()
        out.append(list(loader))
    return out


@pytest.mark.parametrize("dataset", [PerSample(203), Batched(203)], ids=["per sample", "__getitems__"])
def test_any_map_style_dataset_gets_global_batches_and_exact_evaluation(dataset):
    dm = GlobalBatchDataModule(dataset, batch_size=8, val_fraction=0.1, test_fraction=0.1, seed=3)
    dm.setup("fit")
    assert [len(dm.splits[s]) for s in ("train", "val", "test")] == [163, 20, 20]
    ids = torch.cat([dm.splits[s][torch.arange(len(dm.splits[s]))]["x"][:, 0] for s in ("train", "val", "test")])
    assert sorted(ids.long().tolist()) == list(range(203))  # a partition of the samples
    (one,) = _batches(dm, "train", 1)
    two = _batches(dm, "train", 2)
    assert len(one) == 163 // 8 == len(two[0]) == len(two[1])
    for step, batch in enumerate(one):  # the same global batches in the same order on both world sizes
        assert torch.equal(torch.cat([two[0][step]["x"], two[1][step]["x"]]), batch["x"])
    for split in ("val", "test"):  # every sample once over the ranks, whatever the world size
        seen = torch.cat([b["x"][:, 0] for r in _batches(dm, split, 4) for b in r])
        assert sorted(seen.tolist()) == sorted(dm.splits[split][torch.arange(20)]["x"][:, 0].tolist())


def test_an_empty_chunk_keeps_the_batch_structure_and_tensor_data_takes_one_index():
    view = Batches(PerSample(5))
    empty = view[torch.zeros(0, dtype=torch.long)]
    assert empty["x"].shape == (0, 3) and empty["y"].shape == (0,)
    x = torch.randn(10, 2)
    tensors = Batches(TensorDataset(x, torch.arange(10)), ids=torch.tensor([9, 8, 7]))
    assert torch.equal(tensors[torch.tensor([0, 2])][0], x[[9, 7]])
    assert len(Batches(PerSample(5), with_index=True)[torch.tensor([1, 2])]["index"]) == 2


def test_lightning_leaves_the_global_batch_sampler_alone():
    """Lightning wraps a loader's sampler in a DistributedSampler unless it is one already (use_distributed_sampler
    left on): the global-batch sampler is one by type, so nothing is split twice."""
    from torch.utils.data import DistributedSampler

    assert isinstance(GlobalBatchSampler(10, 2, 1, 2), DistributedSampler)


def test_a_users_loader_is_sharded_keeping_the_global_batch():
    ds = PerSample(21)
    user = DataLoader(ds, batch_size=4)
    whole = [b["x"][:, 0].tolist() for b in shard_loader(user, 0, 1, train=False)]
    ranks = [[b["x"][:, 0].tolist() for b in shard_loader(user, r, 2, train=False)] for r in range(2)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == whole  # each global batch split, every sample once
    train = [[b["x"][:, 0].tolist() for b in shard_loader(user, r, 2, train=True)] for r in range(2)]
    assert len(train[0]) == 5 and [a + b for a, b in zip(*train, strict=True)] == whole[:5]  # the partial batch dropped
    assert all(len(b) == 2 for r in train for b in r)
    with pytest.raises(ConfigError, match="does not divide by the world size 3"):
        list(shard_loader(user, 0, 3, train=True))


def _epoch(loader, epoch: int) -> list[list[int]]:
    loader.batch_sampler.set_epoch(epoch)
    return [b["x"][:, 0].long().tolist() for b in loader]


def test_a_wrapped_loaders_training_order_is_a_function_of_seed_and_epoch():
    """The README's advice (shuffle=True with a generator made once per fit) gave epoch k the k-th draw of the
    generator's stream, which a new process (a continued run) starts again: the wrapper orders each epoch by
    (seed, epoch) instead, on any world size, and counts only the full batches it yields."""
    ds = PerSample(23)

    def user(seed: int) -> DataLoader:  # built again, as a continued run's process builds it
        return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))

    first = shard_loader(user(1), 0, 1, train=True, seed=5)
    assert len(first) == 23 // 4 == len(_epoch(first, 0))
    epochs = [_epoch(first, e) for e in (0, 1, 2)]
    again = shard_loader(user(2), 0, 1, train=True, seed=5)
    assert [_epoch(again, e) for e in (2, 1, 0)] == epochs[::-1]  # any epoch, in any process, from (seed, epoch)
    assert epochs[0] != epochs[1] and _epoch(shard_loader(user(1), 0, 1, train=True, seed=6), 0) != epochs[0]
    ranks = [shard_loader(user(1), r, 2, train=True, seed=5) for r in range(2)]
    assert [[a + b for a, b in zip(*[_epoch(r, 1) for r in ranks], strict=True)]] == [epochs[1]]
    replaced = DataLoader(ds, batch_size=4, sampler=torch.utils.data.RandomSampler(ds, replacement=True))
    assert _epoch(shard_loader(replaced, 0, 1, True, 5), 3) == _epoch(shard_loader(replaced, 0, 1, True, 5), 3)


class EpochSeeded(torch.utils.data.Sampler):
    """A user's sampler ordered by (seed, epoch): the generator is seeded inside ``__iter__``."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist())


def test_a_training_sampler_that_cannot_be_ordered_by_seed_and_epoch_is_refused_in_one_line():
    ds = PerSample(23)
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 23, 23, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"sampler \(WeightedRandomSampler\) gives another order each time") as err:
        shard_loader(DataLoader(ds, batch_size=4, sampler=weighted), 0, 1, train=True)
    assert "\n" not in str(err.value)
    seeded = shard_loader(DataLoader(ds, batch_size=4, sampler=EpochSeeded(23)), 0, 1, train=True)
    assert _epoch(seeded, 1) == _epoch(seeded, 1) != _epoch(seeded, 0)
    own = DataLoader(ds, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ConfigError, match="a batch sampler of its own"):
        shard_loader(own, 0, 1, train=True)
    assert len(list(shard_loader(own, 0, 1, train=False))) == 2  # evaluation takes any batches
    with pytest.raises(ConfigError, match="fewer than one batch of 32: no step would train"):
        shard_loader(DataLoader(ds, batch_size=32), 0, 1, train=True)


def test_a_loader_that_cannot_be_sharded_is_refused_in_one_line():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ConfigError, match="IterableDataset") as err:
        shard_loader(DataLoader(Stream(), batch_size=2), 0, 2, train=True)
    assert "\n" not in str(err.value)


def test_a_users_data_module_under_ddp_is_refused_unless_sharded():
    user = "lightning.pytorch.demos.boring_classes.BoringDataModule"
    ddp = ["strategy=ddp", "devices=2", "accelerator=cpu", "model.num_features=32", "model.num_classes=2"]
    cfg = compose_cfg(*ddp, f"data._target_={user}", "~data.num_samples", "~data.num_features", "~data.num_classes",
                      "~data.batch_size", "~data.val_fraction", "~data.test_fraction", "~data.label_noise",
                      "~data.seed", "~data.streaming")  # fmt: skip
    with open_dict(cfg):
        del cfg.data.micro_batch_size  # null: Hydra's ~ cannot drop it
    with pytest.raises(ConfigError, match="data=sharded") as err:
        check_config(cfg)
    assert "\n" not in str(err.value)
    check_config(compose_cfg(*ddp, "data=sharded", f"+data.module._target_={user}"))
    assert isinstance(ShardedDataModule(module=None), ShardedDataModule)  # type: ignore[arg-type]


def test_the_draws_probe_reads_a_sharded_loader_with_workers_in_this_process():
    """The probe before a fit takes a worker loader's first batch through the wrapper's data set (no worker
    started), so a model's nn.Dropout is still named under data=sharded with num_workers > 0."""

    class Workers(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, torch.arange(8) % 3), batch_size=4, num_workers=1)

    class Dropped(MLPClassifier):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(nn.functional.dropout(x, 0.5, self.training))

    model = Dropped(num_features=4, num_classes=3, hidden=[8])
    draws = find_draws(model, ShardedDataModule(Workers()))
    assert not isinstance(draws, str), draws
    assert [d.name for d in draws] == ["model.forward"]


def test_tables_are_bundled_and_their_sizes_are_checked():
    dm = TableDataModule("breast_cancer", num_features=30, num_classes=2, batch_size=32, seed=0)
    dm.setup("fit")
    x, y = dm.splits["train"][torch.arange(4)]
    assert x.shape == (4, 30) and y.dtype == torch.long
    assert sum(len(dm.splits[s]) for s in ("train", "val", "test")) == 569
    with pytest.raises(ConfigError, match="set data.num_classes=10"):
        TableDataModule("digits", num_features=64, num_classes=3).setup("fit")
    cfg = compose_cfg("data=digits", "model=mlp")
    check_config(cfg)
    assert cfg.model.num_features == 64 and cfg.model.num_classes == 10  # the model's sizes follow the data


def test_the_contract_names_what_a_model_does_not_log():
    class FakeTrainer:
        world_size, limit_val_batches, sanity_checking, global_step = 1, 1.0, False, 3
        callback_metrics = {"train/loss": torch.tensor(1.0), "val/loss": torch.tensor(1.0)}

    tally = FitTally()
    contract = MetricContract(tally)
    contract._check_names(FakeTrainer(), "fit")  # type: ignore[arg-type]
    assert contract.warned == set()  # no validation ran in this fit: the final weights' comes after it
    tally.on_validation_end(FakeTrainer(), None)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="logs no val/acc"):
        contract._check_names(FakeTrainer(), "fit")  # type: ignore[arg-type]
    assert contract.warned == {"val/acc"}
