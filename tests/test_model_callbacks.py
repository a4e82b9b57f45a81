"""Callbacks a model returns from ``configure_callbacks()`` (Lightning adds them after the Trainer's): a stateful
one continues exactly from a checkpoint written inside an epoch (a SIGTERM's, an interval's), and one that needs a
logger is refused in one line without one. In-process, one process."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, compose_cfg, global_step, max_diff, weights
from lightning.pytorch.callbacks import LearningRateMonitor

from dpddp.check import STOP_CALLBACK, compare
from dpddp.errors import Preempted, shell
from dpddp.models.mlp import MLPClassifier
from dpddp.run.training import train

BASE = ["accelerator=cpu", "logger=none", "data.num_samples=1024", "trainer.max_epochs=3", *QUIET]
BASE += ["callbacks.model_checkpoint=null", "model._target_=test_model_callbacks.CountingMLP", STOP_CALLBACK]
# 1024 samples: 12 optimizer steps an epoch; the model's StopAtCount ends the fit at step 20, inside epoch 1
STOP_AT = 20


class StopAtCount(pl.Callback):
    """Counts the training batches that ended (its state) and ends the fit when the count reaches ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.count = at, 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.count += 1
        if self.count >= self.at:
            trainer.should_stop = True

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.count = state_dict["count"]


class CountingMLP(MLPClassifier):
    """The MLP whose ``configure_callbacks()`` returns a ``StopAtCount(STOP_AT)``."""

    def configure_callbacks(self):
        return [StopAtCount(STOP_AT)]


class FailAtStep(pl.Callback):
    """Raises ``RuntimeError`` before the training batch that takes global step ``step + 1`` (a crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.checkpoint_io.wait()
            raise RuntimeError("injected crash")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight")
    train(compose_cfg(*BASE), run)
    return run


@pytest.mark.parametrize(
    ("stop", "raised"),
    [
        (["+callbacks.kill._target_=conftest.SigtermAtStep", "+callbacks.kill.step=15"], Preempted),
        (["checkpoint.every_n_steps=5", "+callbacks.crash._target_=test_model_callbacks.FailAtStep",
          "+callbacks.crash.step=17"], RuntimeError),
    ],
    ids=["sigterm", "interval"],
)  # fmt: skip
def test_a_models_stateful_callback_continues_from_a_checkpoint_inside_an_epoch(tmp_path, straight, stop, raised):
    """The checkpoint a SIGTERM or an interval writes inside epoch 1 holds the model's callback's count of that
    step (it was one behind: the continued run ended at step 21, its weights 2.7e-2 apart)."""
    first = tmp_path / "first"
    with pytest.raises(raised):
        train(compose_cfg(*BASE, *stop), first)
    step = global_step(first)
    assert 12 < step < STOP_AT and (step == 15 or raised is Preempted)  # the interval's: at step 15
    ckpt = torch.load(first / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["callbacks"]["StopAtCount"] == {"count": step}  # the count at the step it was written
    train(compose_cfg(*BASE, f"ckpt_path={first / 'checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert global_step(straight) == global_step(tmp_path / "continued") == STOP_AT  # not STOP_AT + 1
    straight_weights = weights(straight / "checkpoints/last.ckpt")
    assert max_diff(straight_weights, weights(tmp_path / "continued/checkpoints/last.ckpt")) <= 1e-6
    assert compare(straight, tmp_path / "continued", "stop") == (0.0, None)  # what `dpddp.check --stops` compares


class LrMonitorMLP(MLPClassifier):
    """The MLP whose ``configure_callbacks()`` returns a ``LearningRateMonitor`` (it needs a logger)."""

    def configure_callbacks(self):
        return LearningRateMonitor()


@pytest.mark.parametrize("strategy", [[], ["strategy=ddp", "devices=2"]], ids=["one process", "ddp(2)"])
def test_a_models_callback_that_needs_a_logger_without_one_is_one_line(tmp_path, capsys, strategy):
    """As ``callbacks.<key>``'s is (it was Lightning's traceback, exit 1, from every rank): before any rank starts."""
    args = [*BASE, "model._target_=test_model_callbacks.LrMonitorMLP", *strategy]
    with pytest.raises(SystemExit) as end, shell():
        train(compose_cfg(*args), tmp_path / "run")
    assert end.value.code == 2
    assert capsys.readouterr().err == (
        "error: LrMonitorMLP.configure_callbacks() returns LearningRateMonitor, which needs a logger, and logger=none: "
        "use logger=csv (or tensorboard, mlflow, wandb), or leave it out of configure_callbacks\n"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
    if not strategy:  # with a logger it runs
        train(compose_cfg(*args, "logger=csv", "trainer.max_steps=2"), tmp_path / "logged")
        assert global_step(tmp_path / "logged") == 2
