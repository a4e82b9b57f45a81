"""Predictions for any model: a model without a predict_step predicts its forward on the batch's inputs,
predictions.csv carries each sample's row in the data set on any world size, a model or data that cannot be
predicted is refused before anything trains, and a failed predict keeps the fit's and test's outputs."""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, ROOT, compose_cfg, metrics, run_project, train_py_here
from test_any_data import PerSample
from test_bring_your_own import USER_ARGS, _project, train_here
from torch.utils.data import Subset, TensorDataset

from dpddp.data.batches import Batches, batch_inputs, dataset_rows
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.sharded import ShardedDataModule
from dpddp.errors import ConfigError
from dpddp.models.linear import LinearClassifier
from dpddp.report.predictions import PredictFailed
from dpddp.run.training import train


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path)))


def test_a_split_knows_the_rows_of_the_whole_data_set_it_holds():
    ids = torch.tensor([7, 3, 9, 0])
    assert Batches(PerSample(10), ids).rows(torch.tensor([2, 0])).tolist() == [9, 7]
    split = Batches(TensorDataset(torch.zeros(105, 1), torch.zeros(105)), torch.arange(100, 105))  # a contiguous cut
    assert split.rows(torch.tensor([4])).tolist() == [104]
    inner = Subset(PerSample(20), [19, 5, 11])  # a split of a Subset: through its indices
    assert Batches(inner, torch.tensor([2, 1])).rows(torch.tensor([0, 1])).tolist() == [11, 5]
    assert dataset_rows(PerSample(4), torch.tensor([3])).tolist() == [3]
    view = Batches(Batches(PerSample(10), ids), with_index=True)  # the predict loader's view of a split
    batch = view[torch.tensor([1, 3])]
    assert batch["index"].tolist() == [3, 0] and batch["x"][:, 0].tolist() == [3.0, 0.0]  # the samples it serves
    tensors = Batches(Batches(TensorDataset(torch.arange(6.0)[:, None]), torch.tensor([5, 4])), with_index=True)
    assert tensors[torch.tensor([0])][-1].tolist() == [5]


def test_the_inputs_of_a_batch_are_its_first_element():
    x = torch.randn(3, 2)
    assert batch_inputs((x, torch.zeros(3))) is x and batch_inputs([x]) is x and batch_inputs(x) is x
    assert batch_inputs({"x": x}) is None and batch_inputs(()) is None


def test_a_model_with_neither_predict_step_nor_forward_is_refused_before_anything_trains(tmp_path):
    cfg = compose_cfg("model._target_=test_predictions.NoForward", "predict=true", *QUIET)
    with pytest.raises(ConfigError, match="predict=true: NoForward has no predict_step and no forward: give it"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


class NoForward(LinearClassifier):
    """The built-in linear classifier without a forward or a predict_step of its own."""

    forward = pl.LightningModule.forward
    predict_step = pl.LightningModule.predict_step


class NoPredictStep(LinearClassifier):
    """The built-in linear classifier without a predict_step of its own."""

    predict_step = pl.LightningModule.predict_step


class DictSamples(PerSample):
    """100 dict samples ``{"x": [3], "y": []}``."""

    def __init__(self) -> None:
        super().__init__(100)


def test_dict_batches_for_a_model_without_predict_step_are_refused_at_setup(tmp_path):
    """The data's batches are dicts: the model's forward has no inputs to take; refused before the first step."""
    args = ["data=dataset", "+data.dataset._target_=test_predictions.DictSamples", "data.batch_size=8"]
    args += ["model._target_=test_predictions.NoPredictStep", "model.num_features=3", "model.num_classes=2"]
    args += ["predict=true", *QUIET]
    with pytest.raises(ConfigError, match=r"predict=true: the data's batches are dicts \(keys x, y\) and NoPredictSt"):
        train(compose_cfg(*args), tmp_path / "run")
    assert not (tmp_path / "run/checkpoints").exists()  # refused before the first training step


def test_a_failed_predict_keeps_the_fit_and_test_metrics(tmp_path):
    args = ["trainer.max_epochs=1", "predict=true", "+callbacks.boom._target_=conftest.PredictFails", *QUIET]
    with pytest.raises(PredictFailed, match=r"^predict failed \(metrics.json of the fit and test is written\): "):
        train(compose_cfg(*args), tmp_path / "run")
    written = metrics(tmp_path / "run")
    assert written["test/acc"] > 0.5 and written["val/loss"] < 2 and written["train/loss"] < 2  # the fit's, the test's
    assert written["predict_error"] == "RuntimeError: injected failure in predict"
    assert (tmp_path / "run/checkpoints/last.ckpt").is_file() and not (tmp_path / "run/predictions.csv").exists()


# The template model of docs/your-model-and-data.md (no predict_step) and data set, in a user's project.


def _expected_rows(project: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The test split's rows of ``mine.Blobs()`` (as ``data=dataset`` cuts it, seed 0), and the data set's x, y."""
    sys.path.insert(0, str(project))
    sys.modules.pop("mine", None)  # another test's module of that name
    try:
        import mine  # the user's module, as the run imports it

        blobs = mine.Blobs()
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("mine", None)
    dm = GlobalBatchDataModule(blobs, batch_size=32)
    dm.setup("fit")
    return dm.splits["test"].ids, blobs.x, blobs.y  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_the_readme_template_model_predicts_the_data_sets_rows(tmp_path, monkeypatch, caplog, devices):
    """On 1 process trained here (the predictions are the point, not the process); on 2, as train.py's ranks."""
    project = _project(tmp_path)
    args = [*USER_ARGS, "trainer.max_epochs=1", "predict=true"]
    if devices == 1:
        with caplog.at_level(logging.INFO):
            train_here(project, args, "run", monkeypatch)
        said = caplog.text
    else:
        ddp = ["strategy=ddp", "devices=2", "hydra.run.dir=run"]
        proc = run_project(project, *args, *ddp, pythonpath=[ROOT / "tests"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = proc.stderr + proc.stdout
    assert f"predictions: {project / 'run/predictions.csv'} (101 rows)" in said
    rows = _rows(project / "run/predictions.csv")
    assert list(rows[0]) == ["index", "target", "pred", "out_0", "out_1", "out_2"]  # the forward's outputs
    test_rows, x, y = _expected_rows(project)
    index = torch.tensor([int(r["index"]) for r in rows])
    assert index.tolist() == sorted(test_rows.tolist())  # each test sample once, by its row in the data set
    assert [int(r["target"]) for r in rows] == y[index].tolist()  # the row's own label
    state = torch.load(project / "run/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    net.load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")})
    with torch.no_grad():
        expected = net(x[index])
    out = torch.tensor([[float(r[f"out_{c}"]) for c in range(3)] for r in rows])
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)  # forward on that row's inputs
    assert [int(r["pred"]) for r in rows] == expected.argmax(1).tolist()


@pytest.mark.slow
def test_a_failed_predict_in_a_sweep_keeps_the_jobs_metrics_and_says_predict_failed(tmp_path, monkeypatch, capfd):
    """The user's train.py runs here, twice (its exit status, a job's files and the summary are the point)."""
    project = _project(tmp_path)
    boom = ["+callbacks.boom._target_=conftest.PredictFails", "predict=true", "trainer.max_epochs=1"]
    sweep = ["-m", *USER_ARGS, *boom, "seed=0", "hydra.sweep.dir=sweep"]
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.setitem(sys.modules, "mine", None)  # undone after the test: sys.modules' "mine" as it was before
    monkeypatch.delitem(sys.modules, "mine")  # the run imports the user's module of this project
    assert train_py_here(*sweep, cwd=project, monkeypatch=monkeypatch) == 1
    error = (project / "sweep/0/error.txt").read_text()
    said = "PredictFailed: predict failed (metrics.json of the fit and test is written): RuntimeError: injected"
    assert error.startswith(said)
    written = metrics(project / "sweep/0")
    assert written["test/acc"] > 0.9 and written["predict_error"] == "RuntimeError: injected failure in predict"
    (row,) = _rows(project / "sweep/summary.csv")
    assert row["status"] == f"failed: {error.strip()}"
    assert float(row["test/acc"]) == written["test/acc"] and float(row["val/loss"]) < 1  # the row keeps them
    capfd.readouterr()
    again = train_py_here(*sweep, cwd=project, monkeypatch=monkeypatch)  # the same command runs it again:
    assert again == 1 and "already complete" not in "".join(capfd.readouterr())  # a failed predict is not complete
    assert json.loads((project / "sweep/0/metrics.json").read_text())["predict_error"]


class _Rank:
    """What the data modules read of a Trainer: the rank and the world size."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.global_rank, self.world_size = rank, world_size


class OwnLoaders(pl.LightningDataModule):
    """A user's data module with its own DataLoaders; its predict loader reads rows 10..49 of a 50-row table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = TensorDataset(torch.arange(50.0)[:, None], torch.arange(50) % 3)

    def predict_dataloader(self):
        return torch.utils.data.DataLoader(Subset(self.table, range(10, 50)), batch_size=7)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_sharded_data_modules_predict_batches_carry_their_rows(world_size):
    dm = ShardedDataModule(OwnLoaders())
    seen = []
    for rank in range(world_size):
        dm.trainer = _Rank(rank, world_size)  # type: ignore[assignment]
        for x, y, rows in dm.predict_dataloader():
            assert torch.equal(x[:, 0], rows.float()) and torch.equal(y, rows % 3)  # its samples' rows
            seen += rows.tolist()
    assert sorted(seen) == list(range(10, 50))  # every sample once over the ranks, by its row in the table
