"""Data built in code from the global random streams (``torch.randn``, ``np.random``, ``random_split`` without a
generator) is the same on every rank and world size (issue 52, case 66): ``dpddp.data.built``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import QUIET, ROOT, compose_cfg, leftover, max_diff, metrics, run_train, weights
from torch.utils.data import DataLoader, TensorDataset
from users_models import GlobalStreamData

from dpddp.data.built import SameDataOnEveryRank, data_checksum
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.sharded import ShardedDataModule
from dpddp.errors import ConfigError
from dpddp.run.training import train


def _streams() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same_streams(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _built(make, rank_seed: int):
    """``make()`` set up after the global streams were seeded with ``rank_seed`` (as a rank's would be)."""
    pl.seed_everything(rank_seed, verbose=False)
    before = _streams()
    data = make()
    data.setup("fit")
    assert _same_streams(before, _streams())  # put back afterwards
    return data


def test_make_dataset_and_random_split_from_the_global_streams_build_one_data_set_whatever_the_streams():
    a, b = (_built(lambda: GlobalStreamData(batch_size=8, seed=3), s) for s in (0, 12345))
    assert data_checksum(a.splits) == data_checksum(b.splits)
    for name in ("train", "val", "test"):
        ids = torch.arange(len(a.splits[name]))
        assert [len(a.splits[name])] * 2 == [len(b.splits[name]), len(ids)]
        assert all(torch.equal(x, y) for x, y in zip(a.splits[name][ids], b.splits[name][ids], strict=True))
    other = _built(lambda: GlobalStreamData(batch_size=8, seed=4), 0)  # the data seed picks the data
    assert data_checksum(other.splits) != data_checksum(a.splits)


class _OwnSetup(GlobalBatchDataModule):
    """A subclass that builds its splits in its own ``setup`` (wrapped like ``make_splits``)."""

    def setup(self, stage: str | None = None) -> None:
        x = torch.randn(40, 3)
        self.splits = {k: TensorDataset(x[i::3], x[i::3, 0] > 0) for i, k in enumerate(("train", "val", "test"))}


class _ModuleWithRandomSetup(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.x = torch.randn(5)

    def train_dataloader(self) -> DataLoader:  # data built lazily in a loader hook, from the global stream
        return DataLoader(TensorDataset(self.x + torch.randn(5)), batch_size=1)


def test_a_subclass_setup_and_a_wrapped_modules_setup_draw_one_data_set():
    a, b = (_built(lambda: _OwnSetup(batch_size=4, seed=1), s) for s in (0, 99))
    assert torch.equal(a.splits["train"].tensors[0], b.splits["train"].tensors[0])
    c, d = (_built(lambda: ShardedDataModule(_ModuleWithRandomSetup(), seed=1), s) for s in (0, 99))
    assert torch.equal(c.module.x, d.module.x)
    loaders = []
    for data, rank_seed in ((c, 0), (d, 99)):
        torch.manual_seed(rank_seed)
        loaders.append(data.train_dataloader())
    assert torch.equal(*(loader.dataset.dataset.tensors[0] for loader in loaders))


def test_ranks_with_different_data_are_one_line_naming_the_data_module():
    data = GlobalStreamData(batch_size=8)
    data.setup("fit")
    mine = data_checksum(data.splits)

    def trainer(other: int) -> SimpleNamespace:
        gather = lambda t: torch.stack([t, torch.tensor(other)])  # noqa: E731  # rank 1's checksum
        strategy = SimpleNamespace(all_gather=gather, root_device=torch.device("cpu"))
        return SimpleNamespace(datamodule=data, world_size=2, strategy=strategy)

    SameDataOnEveryRank().setup(trainer(mine), None, "fit")  # the same: nothing said
    with pytest.raises(ConfigError, match=r"^data: GlobalStreamData built different data on the ranks") as err:
        SameDataOnEveryRank().setup(trainer(mine + 1), None, "fit")
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_data_built_from_the_global_streams_trains_on_ddp_as_on_one_process(tmp_path):
    common = (
        "data=dataset", "data._target_=users_models.GlobalStreamData", "data.batch_size=16", "model.num_features=16",
        "model.num_classes=4", "accelerator=cpu", "trainer.max_epochs=2",
    )  # fmt: skip
    env = {"PYTHONPATH": str(ROOT / "tests")}
    train(compose_cfg(*common, *QUIET), tmp_path / "one")  # what train.py runs, in this process
    proc = run_train(*common, "strategy=ddp", "devices=2", f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(proc.tag) == []
    runs = {"one": tmp_path / "one", "ddp": tmp_path / "ddp"}
    diff = max_diff(*(weights(runs[n] / "checkpoints/last.ckpt") for n in ("one", "ddp")))
    assert diff <= 1e-5  # was 2.95 apart (case 66): each rank built its own data set
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert metrics(runs["ddp"])[key] == pytest.approx(metrics(runs["one"])[key], abs=1e-5), key
