"""``checkpoint.every_n_steps`` / ``checkpoint.every_seconds``: ``last.ckpt`` written inside an epoch, at a closed
accumulation window, in the background and atomically; a run SIGKILLed after one continues (``resume=true``) to
the straight run's weights, training again fewer than ``every_n_steps`` steps."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, compose_cfg, global_step, max_diff, run_train, weights
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dpddp.continuity.io import BACKGROUND, AtomicCheckpointIO, checkpoint_intervals
from dpddp.errors import ConfigError
from dpddp.run.config import check_config
from dpddp.run.training import train

# 6 optimizer steps an epoch (12 batches, 2 a step), 12 in all.
BASE = ["accelerator=cpu", "data.num_samples=1005", "logger=none", "trainer.max_epochs=2"]
BASE += ["trainer.accumulate_grad_batches=2", "callbacks.model_checkpoint=null"]
EVERY = 4


class SigkillAtStep(pl.Callback):
    """Test helper: once the background write in flight is done, SIGKILLs this process before the training batch
    that takes global step ``step + 1``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.checkpoint_io.wait()
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_run_killed_after_a_step_interval_checkpoint_continues_to_the_straight_runs_weights(tmp_path):
    run = tmp_path / "run"
    args = [*BASE, f"checkpoint.every_n_steps={EVERY}", f"hydra.run.dir={run}"]
    kill = ["+callbacks.kill._target_=test_interval_checkpoints.SigkillAtStep", "+callbacks.kill.step=10"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    killed = run_train(*args, *kill, cwd=tmp_path, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    saved = global_step(run)
    assert saved == 8 and 10 - saved <= EVERY  # written inside epoch 1 (steps 6-12): 2 steps are trained again
    assert not (run / "checkpoints" / "last.ckpt.tmp").exists()
    run_train(*args, "resume=true", cwd=tmp_path, env=env, check=True)
    train(compose_cfg(*BASE), tmp_path / "straight")
    assert global_step(run) == global_step(tmp_path / "straight") == 12
    assert (
        max_diff(weights(run / "checkpoints/last.ckpt"), weights(tmp_path / "straight/checkpoints/last.ckpt")) <= 1e-6
    )


def test_a_background_write_leaves_the_previous_checkpoint_whole_until_it_is_complete(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    started, release = threading.Event(), threading.Event()
    save = TorchCheckpointIO.save_checkpoint

    def slow_save(self, checkpoint, path, storage_options=None):  # half the file, then a wait: a kill lands here
        Path(path).write_bytes(b"PK\x03\x04 half")
        started.set()
        release.wait(10)
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", slow_save)
    weights_now = torch.full((3,), 2.0)
    io.save_checkpoint({"global_step": 2, "w": weights_now}, path, storage_options=BACKGROUND)
    weights_now.add_(5.0)  # the training thread goes on: the write holds its own copy
    assert started.wait(10)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert (tmp_path / "last.ckpt.tmp").exists()
    release.set()
    io.teardown()
    written = torch.load(path, weights_only=True)
    assert written["global_step"] == 2 and written["w"].tolist() == [2.0, 2.0, 2.0]
    assert io.saved_steps == {"last.ckpt": 2} and not (tmp_path / "last.ckpt.tmp").exists()


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "checkpoint.every_n_steps=0",
            "checkpoint.every_n_steps=0 is invalid: use a positive number of optimizer steps",
        ),
        ("checkpoint.every_seconds=-5", "checkpoint.every_seconds=-5 is invalid: use a positive number of seconds"),
        ("+checkpoint.every_step=3", "unknown setting checkpoint.every_step: did you mean checkpoint.every_n_steps?"),
    ],
)
def test_a_bad_interval_is_one_config_line(override, line):
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(override))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_every_seconds_auto_is_on_under_a_cluster_launcher_only(monkeypatch):
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert checkpoint_intervals(compose_cfg()) == (None, None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert checkpoint_intervals(compose_cfg("checkpoint.every_n_steps=3")) == (3, 600.0)
    assert checkpoint_intervals(compose_cfg("trainer.enable_checkpointing=false")) == (None, None)
