"""debug/ presets, the config-tree switch, and more than one logger at once."""

import logging

import pytest
import torch
from conftest import QUIET, compose_cfg

from dpddp.run.config import check_config
from dpddp.run.training import train


@pytest.mark.parametrize(
    "preset,expected",
    [
        ("fast_dev_run", {"trainer.fast_dev_run": True, "print_config": True}),
        ("overfit", {"data.num_samples": 240, "trainer.max_epochs": 50}),
        ("profiler", {"trainer.profiler": "simple", "trainer.max_epochs": 1, "callbacks.last_checkpoint": None}),
        ("limit", {"trainer.limit_train_batches": 5, "trainer.limit_val_batches": 2, "trainer.max_epochs": 2}),
    ],
)
def test_debug_presets_compose_and_pass_the_check(preset, expected):
    cfg = compose_cfg(f"debug={preset}")
    check_config(cfg)
    for key, value in expected.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == value, key
    assert not cfg.logger and cfg.epoch_lines is True  # logger=none: an empty group
    assert compose_cfg(f"debug={preset}", "trainer.max_epochs=7").trainer.max_epochs == 7  # the command line wins


def test_debug_limit_trains_its_few_batches(tmp_path):
    """2 epochs of 5 batches of 64, then 2 validation and 2 test batches (128 samples each) of the final weights:
    the accuracies and losses of that run (seed 0; chance is 0.25 on 4 classes), to one sample either way."""
    result = train(compose_cfg("debug=limit", *QUIET, "accelerator=cpu"), tmp_path)
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2 * 5
    assert result["val/acc"] * 128 == pytest.approx(112, abs=1) and result["test/acc"] * 128 == pytest.approx(
        108, abs=1
    )
    assert result["val/loss"] == pytest.approx(0.6054, abs=1e-3) and result["test/loss"] == pytest.approx(
        0.6452, abs=1e-3
    )


def test_print_config_logs_the_resolved_tree_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dpddp.run.training"):
        train(compose_cfg("debug=fast_dev_run", *QUIET, "accelerator=cpu"), tmp_path)
    trees = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config:\n")]
    assert len(trees) == 1 and "fast_dev_run: true" in trees[0] and "num_features: 16" in trees[0]


def test_two_loggers_at_once_write_both(tmp_path):
    train(compose_cfg("logger=csv_tensorboard", *QUIET, "accelerator=cpu", "trainer.max_epochs=1"), tmp_path)
    assert (tmp_path / "csv/version_0/metrics.csv").read_text().startswith("epoch")
    assert list((tmp_path / "tensorboard/version_0").glob("events.out.tfevents.*"))
