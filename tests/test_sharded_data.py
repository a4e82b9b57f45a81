"""A user's data module with its own loaders, wrapped by ``data=sharded``, end to end: it trains every epoch on a
training split that does or does not divide by the batch, and a run stopped mid-epoch on 2 or 3 processes and
continued on 3 or 1 ends with the weights of one process's straight run (each world size trains a segment). The
loaders are the usual ones: ``Subset`` splits and ``shuffle=True`` with a generator seeded once per fit
(``users_models.SplitData``)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import ROOT, compose_cfg, leftover, made_once, max_diff, metrics, run_train, train_py_here, weights

from dpddp.run.training import train

pytestmark = pytest.mark.slow

BATCH = 12  # divides by 1, 2 and 3 processes; 96 and 101 training samples are both 8 batches an epoch
STEPS = 3 * 8


SPLIT = ["accelerator=cpu", "model.num_features=4", "model.num_classes=3", "data=sharded"]
SPLIT += ["+data.module._target_=users_models.SplitData", f"+data.module.batch_size={BATCH}"]


def _here(run: Path, *args: str) -> None:
    """One process's straight run of ``SPLIT`` and ``args``, trained in this process (what train.py runs)."""
    train(compose_cfg(*SPLIT, *args), run)


def _train(run: Path, num_train: int, procs: int, monkeypatch: pytest.MonkeyPatch, *more: str) -> dict:
    """``train.py`` on the wrapped ``users_models.SplitData`` into ``run`` (1 process: trained here, its ranks are
    not the point); its metrics."""
    args = [*SPLIT, "trainer.max_epochs=3", f"+data.module.num_train={num_train}", *more, f"hydra.run.dir={run}"]
    if procs == 1:
        assert train_py_here(*args, cwd=run.parent, monkeypatch=monkeypatch) == 0
        return metrics(run)
    proc = run_train(*args, "strategy=ddp", f"devices={procs}", cwd=run.parent, env={"PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(proc.tag) == []
    return metrics(run)


def _epochs(run: Path) -> list[tuple[int, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(int(r["epoch"]), r["val/loss"]) for r in csv.DictReader(f) if r["stage"] == "fit"]


# Each split kind and each world change once (was their 4 crossings): an even split stopped on 2 continues on 3, an
# uneven one stopped on 3 continues on 1; the position a stop keeps is global (the world sizes' sharding runs in
# each row's two runs).
@pytest.mark.parametrize(
    "num_train,procs,then", [(96, 2, 3), (101, 3, 1)], ids=["divides-2 then 3", "does not divide-3 then 1"]
)
def test_a_wrapped_data_module_trains_every_epoch_equals_one_process_and_continues_exactly(
    tmp_path, shared_dir, monkeypatch, num_train, procs, then
):
    epochs = ["trainer.max_epochs=3", f"+data.module.num_train={num_train}"]
    straight = made_once(shared_dir, f"sharded_straight_{num_train}", lambda p: _here(p, *epochs))
    assert torch.load(straight / "checkpoints/last.ckpt", weights_only=True)["global_step"] == STEPS
    assert [e for e, _ in _epochs(straight)] == [0, 1, 2] and all(v for _, v in _epochs(straight))  # validated

    _train(tmp_path / "stopped", num_train, procs, monkeypatch, "trainer.max_steps=11")  # a limit, in epoch 1
    stopped = tmp_path / "stopped/checkpoints/last.ckpt"
    assert torch.load(stopped, weights_only=True)["global_step"] == 11
    continued = _train(tmp_path / "continued", num_train, then, monkeypatch, f"ckpt_path={stopped}")
    last = tmp_path / "continued/checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == STEPS and continued["world_size"] == then
    assert [e for e, _ in _epochs(tmp_path / "continued")] == [0, 1, 2]
    tol = 1e-5  # promise 1's tolerance between world sizes (float reduction order)
    assert max_diff(weights(last), weights(straight / "checkpoints/last.ckpt")) <= tol
    for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert continued[key] == pytest.approx(metrics(straight)[key], abs=tol), key


def _dropout_run(run: Path, procs: int) -> Path:
    """``model=mlp`` with ``SampleDropout(0.5)`` on the wrapped ``users_models.SplitData``, 2 epochs, ddp."""
    proc = run_train(
        *SPLIT, "trainer.max_epochs=2", "model=mlp", "model.dropout=0.5", "strategy=ddp", f"devices={procs}",
        f"hydra.run.dir={run}", cwd=run.parent, env={"PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(proc.tag) == []
    return run / "checkpoints/last.ckpt"


# One world size: SampleDropout's masks are keyed by each sample's id (``states_for``), with no branch on the world
# size, so 3 processes (101 samples: an uneven last batch over the ranks) walk the path 2 would (was a [2] row).
@pytest.mark.parametrize("procs", [3])
def test_sample_dropout_under_a_wrapped_data_module_equals_one_process(tmp_path, shared_dir, procs):
    one = ["trainer.max_epochs=2", "model=mlp", "model.dropout=0.5"]
    straight = made_once(shared_dir, "sharded_dropout_one", lambda p: _here(p, *one)) / "checkpoints/last.ckpt"
    keyed = _dropout_run(tmp_path / f"ddp{procs}", procs)
    assert max_diff(weights(keyed), weights(straight)) <= 1e-5  # was 3.4e-2 apart: masks drawn per rank
