"""Randomness and schedulers across a stop: each rank's random state travels with the checkpoint, ranks draw
distinct streams, and every LR scheduler Lightning steps continues exactly."""

from __future__ import annotations

import logging
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import QUIET, compose_cfg, run_train, train_py_here

from dpddp.continuity.state import random_state, rank_seed, set_random_state
from dpddp.run.training import train

BASE = ["model=mlp", "accelerator=cpu", "logger=none", "data.num_samples=1024", *QUIET]
# 1024 samples: 820 train, 12 batches of 64 an epoch


def _state(run: Path) -> dict:
    return torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = _state(a)["state_dict"], _state(b)["state_dict"]
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def test_rank_streams_are_distinct_and_rank_0_keeps_the_seed():
    seeds = [rank_seed(7, r) for r in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4 and rank_seed(7, 1) == rank_seed(7, 1)


def test_the_random_state_loads_with_weights_only_and_replays_every_generator(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save({"r": random_state()}, tmp_path / "s.pt")
    first = (torch.rand(3), np.random.rand(3), random.random())
    set_random_state(torch.load(tmp_path / "s.pt", weights_only=True)["r"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


@pytest.fixture(scope="module")
def dropout_straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight")
    train(compose_cfg(*BASE, "model._target_=users_models.GlobalDropoutMLP", "trainer.max_epochs=3"), run)
    return run


@pytest.mark.parametrize("stop", ["trainer.max_steps=17", "+callbacks.kill._target_=conftest.SigtermAt"])
def test_a_users_global_rng_model_stopped_mid_epoch_and_continued_equals_the_straight_run(
    tmp_path, dropout_straight, stop
):
    """Steps 17 (a limit) or 9 (SIGTERM after batch 8) lie inside an epoch of 12 steps."""
    args = [*BASE, "model._target_=users_models.GlobalDropoutMLP", "trainer.max_epochs=3"]
    _stop_and_continue(tmp_path, args, stop)
    assert _max_diff(tmp_path / "continued", dropout_straight) <= 1e-6


@pytest.mark.parametrize("p", [0.2, 0.5])
@pytest.mark.parametrize("stop", ["trainer.max_steps=17", "+callbacks.kill._target_=conftest.SigtermAt"])
def test_the_builtin_dropout_stopped_mid_epoch_and_continued_equals_the_straight_run(tmp_path, p, stop):
    args = [*BASE, f"model.dropout={p}", "trainer.max_epochs=3"]
    train(compose_cfg(*args), tmp_path / "straight")
    _stop_and_continue(tmp_path, args, stop)
    assert _max_diff(tmp_path / "continued", tmp_path / "straight") <= 1e-6


def _stop_and_continue(tmp_path: Path, args: list[str], stop: str) -> None:
    stopping = [stop, "+callbacks.kill.at=8"] if "kill" in stop else [stop]
    try:
        train(compose_cfg(*args, *stopping), tmp_path / "run")
    except Exception as err:  # the SIGTERM stop ends with Preempted
        assert "stopped by SIGTERM" in str(err)
    assert 0 < _state(tmp_path / "run")["global_step"] % 12
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _state(tmp_path / "continued")["global_step"] == 36


def test_without_its_random_state_the_same_continue_differs(tmp_path, dropout_straight):
    """The check above can fail: the same stop, continued from a checkpoint whose random states are dropped."""
    args = [*BASE, "model._target_=users_models.GlobalDropoutMLP", "trainer.max_epochs=3"]
    train(compose_cfg(*args, "trainer.max_steps=17"), tmp_path / "run")
    ckpt = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    ckpt["dpddp"]["random"] = []
    torch.save(ckpt, tmp_path / "run/checkpoints/last.ckpt")
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _max_diff(tmp_path / "continued", dropout_straight) > 1e-3


@pytest.mark.parametrize("model", ["PlateauMLP", "StepLRMLP"])
@pytest.mark.parametrize("stop", ["trainer.max_epochs=3", "trainer.max_steps=29", "+callbacks.kill.at=29"])
def test_a_scheduler_continues_exactly_across_a_stop(tmp_path, model, stop):
    """A plateau scheduler on val/loss and an epoch scheduler, stopped at an epoch's end, by a limit inside an
    epoch, or by SIGTERM inside an epoch, and continued to 6 epochs: the straight run's weights and learning
    rate."""
    args = [*BASE, f"model._target_=users_models.{model}"]
    train(compose_cfg(*args, "trainer.max_epochs=6"), tmp_path / "straight")
    stopping = [stop, "+callbacks.kill._target_=conftest.SigtermAt"] if "kill" in stop else [stop]
    try:
        train(compose_cfg(*args, "trainer.max_epochs=6", *stopping), tmp_path / "run")
    except Exception as err:  # the SIGTERM stop ends with Preempted
        assert "stopped by SIGTERM" in str(err)
    train(
        compose_cfg(*args, "trainer.max_epochs=6", f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"),
        tmp_path / "c",
    )
    lr = [_state(r)["optimizer_states"][0]["param_groups"][0]["lr"] for r in (tmp_path / "straight", tmp_path / "c")]
    assert lr[0] == lr[1] and lr[0] < 0.2  # the scheduler stepped
    assert _max_diff(tmp_path / "c", tmp_path / "straight") <= 1e-6


@pytest.mark.slow
def test_under_ddp_a_global_rng_layer_is_named_in_one_line_at_start(tmp_path, caplog):
    """2 processes: the user's ``nn.Dropout`` and the ``torch.rand_like`` of its training step are named in one
    line (their draws depend on the world size); the built-in MLP's dropout, whose masks belong to the sample, is
    not (the start check the run makes, on the same config, in this process)."""
    common = ["accelerator=cpu", "strategy=ddp", "devices=2", "trainer.max_epochs=1", "data.num_samples=512"]
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    user = run_train(
        *common, "model=mlp", "model._target_=users_models.GlobalDropoutMLP", "hydra.run.dir=u", cwd=tmp_path, env=env
    )
    assert user.returncode == 0, user.stderr[-2000:]
    lines = [line for line in (user.stdout + user.stderr).splitlines() if "from the global random stream" in line]
    assert len(lines) == 1 and "with 2 replicas" in lines[0], lines
    assert (
        "model.training_step, model.drop draw from the global random streams; use dpddp.nn.SampleDropout(p) in "
        "place of model.drop; draws keyed by the sample in model.training_step" in lines[0]
    )  # rand_like: in its step
    from hydra.utils import instantiate

    from dpddp.parallel.rules import world_of
    from dpddp.run.assembly import _warn_global_rng

    builtin = compose_cfg(*common, "model=mlp", "model.dropout=0.5")
    with caplog.at_level(logging.INFO, logger="dpddp.run.assembly"):
        _warn_global_rng(instantiate(builtin.model), instantiate(builtin.data, _convert_="all"), world_of(builtin))
    assert "global random stream" not in caplog.text


@pytest.mark.slow
def test_a_plateau_scheduler_killed_by_sigkill_and_resumed_equals_the_straight_run(tmp_path, monkeypatch):
    """SIGKILL after batch 40 (epoch 3 of 6): ``resume=true`` (train.py's calls in this process) continues from the
    epoch-3 ``last.ckpt``."""
    args = ["accelerator=cpu", "model=mlp", "model._target_=users_models.PlateauMLP", "data.num_samples=1024"]
    args += ["trainer.max_epochs=6", "hydra.run.dir=run"]
    train(compose_cfg(*QUIET, *args[:-1]), tmp_path / "straight")
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent)])}
    kill = ["+callbacks.kill._target_=conftest.SigkillAt", "+callbacks.kill.at=40"]
    killed = run_train(*args, *kill, cwd=tmp_path, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert _state(tmp_path / "run")["global_step"] == 36  # the last epoch-end checkpoint
    assert train_py_here(*args, "resume=true", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    assert _max_diff(tmp_path / "run", tmp_path / "straight") <= 1e-6


NOISY = ["accelerator=cpu", "logger=none", *QUIET, "data=dataset", "+data.dataset._target_=users_models.NoisyBlobs"]
NOISY += ["model=mlp", "model.num_features=16", "model.num_classes=4", "data.batch_size=32", "trainer.max_epochs=3"]
# 600 samples: 480 train, 15 batches of 32 an epoch


def test_a_data_set_with_set_epoch_is_told_each_epoch_of_the_data():
    from users_models import NoisyBlobs

    from dpddp.data.global_batch import GlobalBatchDataModule

    module = GlobalBatchDataModule(NoisyBlobs(), batch_size=32)
    module.setup("fit")
    loader = module.train_dataloader()
    loader.sampler.set_epoch(2)
    assert module.splits["train"].dataset.epoch == 2
    first = next(iter(loader))[0]
    loader.sampler.set_epoch(3)
    assert module.splits["train"].dataset.epoch == 3 and not torch.equal(first, next(iter(loader))[0])


def test_augmentation_keyed_by_the_sample_continues_exactly_across_a_stop(tmp_path):
    train(compose_cfg(*NOISY), tmp_path / "straight")
    train(compose_cfg(*NOISY, "trainer.max_steps=22"), tmp_path / "run")  # inside epoch 1
    train(compose_cfg(*NOISY, f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _max_diff(tmp_path / "continued", tmp_path / "straight") <= 1e-6


@pytest.mark.slow
def test_augmentation_keyed_by_the_sample_is_the_same_on_two_processes_and_with_loader_workers(tmp_path):
    """ddp(2) as train.py's processes; one loader worker in this process's run."""
    train(compose_cfg(*NOISY), tmp_path / "one")
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    proc = run_train(*NOISY, "strategy=ddp", "devices=2", "hydra.run.dir=two", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    train(compose_cfg(*NOISY, "data.num_workers=1"), tmp_path / "workers")
    for name in ("two", "workers"):
        assert _max_diff(tmp_path / name, tmp_path / "one") <= 1e-5, name


def test_random_states_of_another_world_size_are_not_restored_and_the_run_says_so(caplog):
    """A checkpoint of 2 processes continued on 1: no rank takes another's stream, and one line says why."""
    from types import SimpleNamespace

    from dpddp.continuity.state import ResumableState
    from dpddp.report.epochs import EpochRecord
    from dpddp.report.tally import FitTally
    from dpddp.report.throughput import ThroughputCounts

    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), global_rank=0, world_size=1, strategy=SimpleNamespace())
    owner = ResumableState(ThroughputCounts(), EpochRecord(".", FitTally()))
    entry = {"random": [random_state(), random_state()], "mid_epoch": True}
    with caplog.at_level("INFO", logger="dpddp.continuity.state"):
        owner.on_load_checkpoint(trainer, None, {"dpddp": entry})  # type: ignore[arg-type]
    assert owner._random is None
    assert "the checkpoint holds the random states of 2 processes and this run has 1" in caplog.text
    trainer.world_size = 2
    owner.on_load_checkpoint(trainer, None, {"dpddp": entry})  # type: ignore[arg-type]
    assert owner._random is entry["random"][0]


AUG = [a.replace("NoisyBlobs", "AugBlobs") for a in NOISY]
# AugBlobs: augmentation from the global streams (torch, numpy, Python) in __getitem__; 15 batches an epoch


@pytest.fixture(scope="module")
def aug_straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("aug")
    train(compose_cfg(*AUG), run)
    return run


@pytest.mark.parametrize(
    "dataset,workers",
    [("AugBlobs", 0), pytest.param("AugBlobs", 2, marks=pytest.mark.slow), ("AugBlobsBatched", 0)],
    ids=["no-workers", "2-workers", "getitems"],
)
def test_random_augmentation_in_a_data_set_continues_exactly(tmp_path, aug_straight, dataset, workers):
    """Case 47: a SIGTERM before step 23 (inside epoch 1 of 3) and a continue, with 0 or 2 loader workers (the
    batches fetched ahead drew from the global streams the checkpoint holds, 0.097 and 0.038 off): the straight
    run's weights (made without workers). Each sample's draws are keyed by (seed, epoch, sample), a
    ``__getitems__`` batch's by its first sample."""
    args = [*(a.replace("AugBlobs", dataset) for a in AUG), f"data.num_workers={workers}"]
    if dataset != "AugBlobs":
        train(compose_cfg(*args), tmp_path / "straight")
    straight = aug_straight if dataset == "AugBlobs" else tmp_path / "straight"
    kill = ["+callbacks.kill._target_=conftest.SigtermAtStep", "+callbacks.kill.step=22"]
    with pytest.raises(Exception, match="stopped by SIGTERM"):
        train(compose_cfg(*args, *kill), tmp_path / "run")
    assert _state(tmp_path / "run")["global_step"] == 23
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _state(tmp_path / "continued")["global_step"] == 45
    assert _max_diff(tmp_path / "continued", straight) <= 1e-6


def test_random_augmentation_in_a_data_set_leaves_the_models_draws_as_they_were():
    """A data set's draws from the global streams do not move them: the rank's streams after a fetch are those
    before it, and the same sample draws the same augmentation in another epoch's key only."""
    from users_models import AugBlobs

    from dpddp.data.batches import Batches

    view = Batches(AugBlobs(num_samples=8))
    view.seed = 3
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    before = random_state()
    first = view[torch.tensor([5, 2])][0]
    after = random_state()
    assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]
    assert torch.equal(before["numpy"][1], after["numpy"][1])
    assert torch.equal(view[torch.tensor([2, 5])][0], first.flip(0))  # keyed by the sample, not its place
    view.set_epoch(1)
    assert not torch.equal(view[torch.tensor([5, 2])][0], first)
    assert view.dataset.epoch == 1  # the data set's own set_epoch is told


SHARDED_AUG = ["accelerator=cpu", "logger=none", *QUIET, "data=sharded"]
SHARDED_AUG += ["+data.module._target_=users_models.AugSplitData", "model=mlp", "model.num_features=16"]
SHARDED_AUG += ["model.num_classes=4", "trainer.max_epochs=3"]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["no-workers", "2-workers"])
def test_random_augmentation_in_a_users_own_loaders_continues_exactly(tmp_path, workers):
    """The same kind in a user's data module with its own DataLoaders (``data=sharded``, ``Subset`` splits): a
    SIGTERM before step 23 and a continue end with the straight run's weights (made without workers)."""
    train(compose_cfg(*SHARDED_AUG), tmp_path / "straight")
    args = [*SHARDED_AUG, f"+data.module.num_workers={workers}"]
    kill = ["+callbacks.kill._target_=conftest.SigtermAtStep", "+callbacks.kill.step=22"]
    with pytest.raises(Exception, match="stopped by SIGTERM"):
        train(compose_cfg(*args, *kill), tmp_path / "run")
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _state(tmp_path / "continued")["global_step"] == 45
    assert _max_diff(tmp_path / "continued", tmp_path / "straight") <= 1e-6


@pytest.mark.slow
def test_random_augmentation_in_a_data_set_on_two_processes_stopped_and_resumed_equals_one_process(
    tmp_path, aug_straight
):
    """Keyed by the sample, not the rank: ddp(2) stopped by ``max_steps`` inside epoch 1 and resumed
    (``resume=true``) ends with the weights of the straight one-process run."""
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    args = [*AUG, "strategy=ddp", "devices=2", "hydra.run.dir=run"]
    for extra in (["trainer.max_steps=22"], ["resume=true"]):
        proc = run_train(*args, *extra, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert _state(tmp_path / "run")["global_step"] == 45
    assert _max_diff(tmp_path / "run", aug_straight) <= 1e-5


def test_random_augmentation_no_keyed_fetch_serves_is_named_in_one_line(tmp_path, caplog):
    """A data module's own loaders used as they are (one process): its data set's draws move torch's stream
    between steps, which a continued run cannot replay, and one line says so; served by data=sharded (keyed) and
    by the built-in data, nothing is said."""
    own = ["data=sharded", "data._target_=users_models.AugSplitData", "~data.module", "~data.seed"]
    one = [*SHARDED_AUG[:-1], "trainer.max_epochs=1"]  # SHARDED_AUG ends with the epoch limit
    runs = {"own": [*one, *own], "sharded": one, "builtin": [*BASE, "trainer.max_epochs=1"]}
    said = {}
    for name, args in runs.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dpddp.data.draws"):
            train(compose_cfg(*args), tmp_path / name)
        said[name] = [r.getMessage() for r in caplog.records if r.name == "dpddp.data.draws"]
    assert len(said["own"]) == 1 and said["own"][0].startswith("the training data drew from torch's global random")
    assert said["sharded"] == said["builtin"] == []
