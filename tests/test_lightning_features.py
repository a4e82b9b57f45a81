"""Lightning's own features, reached through dpddp: each is supported or refused in one line before anything is
written, tested by kind: a callback that needs a part the run does not have (a logger)."""

import csv
import inspect

import lightning.pytorch as pl
import pytest
from conftest import QUIET, compose_cfg
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import LearningRateMonitor

from dpddp.errors import ConfigError
from dpddp.run.config import check_config, needs_logger
from dpddp.run.training import train

SMALL = [*QUIET, "accelerator=cpu", "data.num_samples=606", "trainer.max_epochs=1"]


class UsersLoggerCallback(pl.Callback):
    """A user's callback that refuses a Trainer without a logger, as Lightning's monitors do."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.logger is None:
            raise RuntimeError("UsersLoggerCallback needs a logger")


class UsersMonitor(LearningRateMonitor):
    """A user's subclass of a callback that needs a logger."""


# -- a callback that needs a part the run does not have -------------------------------------------------------


def test_the_lightning_callbacks_that_need_a_logger_are_found_from_their_code():
    found = {
        name
        for name in lightning_callbacks.__all__
        if inspect.isclass(cls := getattr(lightning_callbacks, name)) and needs_logger(cls)
    }
    assert found == {"LearningRateMonitor", "DeviceStatsMonitor"}
    assert needs_logger(UsersLoggerCallback) and needs_logger(UsersMonitor)


@pytest.mark.parametrize(
    "target,name",
    [
        ("lightning.pytorch.callbacks.LearningRateMonitor", "LearningRateMonitor"),
        ("lightning.pytorch.callbacks.DeviceStatsMonitor", "DeviceStatsMonitor"),
        ("test_lightning_features.UsersLoggerCallback", "UsersLoggerCallback"),
        ("test_lightning_features.UsersMonitor", "UsersMonitor"),
    ],
)
@pytest.mark.parametrize("strategy", [[], ["strategy=ddp", "devices=2"]], ids=["one process", "ddp(2)"])
def test_a_callback_that_needs_a_logger_without_one_is_one_line(target, name, strategy):
    cfg = compose_cfg("accelerator=cpu", *strategy, f"+callbacks.mon._target_={target}")
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == (
        f"callbacks.mon ({name}) needs a logger, and logger=none: use logger=csv (or tensorboard, mlflow, wandb), "
        "or drop it with callbacks.mon=null"
    )
    check_config(compose_cfg("accelerator=cpu", *strategy, f"+callbacks.mon._target_={target}", "logger=csv"))
    check_config(compose_cfg("accelerator=cpu", *strategy, f"+callbacks.mon._target_={target}", "callbacks.mon=null"))


def test_a_learning_rate_monitor_with_a_logger_logs_the_learning_rate(tmp_path):
    lr = "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"
    train(compose_cfg(*SMALL, lr, "+callbacks.lr.logging_interval=epoch", "logger=csv", "model.lr=0.05"), tmp_path)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("lr-SGD")]
    assert [float(row["lr-SGD"]) for row in rows] == [0.05]
