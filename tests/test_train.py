"""In-process runs through ``train(cfg)`` (one process: auto and dp on CPU)."""

import json

import pytest
import torch
from conftest import QUIET, compose_cfg, max_diff, weights

from dpddp.errors import ConfigError
from dpddp.run.training import METRIC_KEYS, train

SMALL = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "trainer.max_epochs=3", "logger=none"]


def test_defaults_learn_and_write_metrics(tmp_path):
    result = train(compose_cfg(*QUIET), tmp_path)
    written = json.loads((tmp_path / "metrics.json").read_text())
    lists = {k for k, v in written.items() if isinstance(v, list)}  # segment_world_sizes: [1]
    assert lists and {k: written[k] for k in lists} == {k: result[k] for k in lists}
    assert {k: v for k, v in written.items() if k not in lists} == pytest.approx(
        {k: v for k, v in result.items() if k not in lists}
    )
    assert set(METRIC_KEYS) <= written.keys()
    assert written["val/acc"] >= 0.9 and written["test/acc"] >= 0.9
    assert written["world_size"] == 1 and written["strategy"] == "auto" and written["samples_per_sec"] > 0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and (tmp_path / "checkpoints" / "best.ckpt").is_file()
    # one epoch table by default: dpddp's metrics.csv; Lightning's CSV logger only with logger=csv
    assert (tmp_path / "metrics.csv").read_text().startswith("stage,epoch,step") and not (tmp_path / "csv").exists()


def test_dp_on_one_cpu_equals_auto_exactly(tmp_path):
    """strategy=dp, gone from Lightning 2.x, is dpddp's: with accelerator=cpu devices=1 it runs unwrapped: the same
    weights as auto (difference 0)."""
    auto = train(compose_cfg(*SMALL, "strategy=auto"), tmp_path / "auto")
    dp = train(compose_cfg(*SMALL, "strategy=dp"), tmp_path / "dp")
    assert dp["strategy"] == "dp" and dp["world_size"] == 1
    assert (
        max_diff(weights(tmp_path / "auto/checkpoints/last.ckpt"), weights(tmp_path / "dp/checkpoints/last.ckpt")) == 0
    )
    assert dp["val/loss"] == auto["val/loss"]


def test_resume_equals_uninterrupted(tmp_path):
    """2 epochs, then resume to 4 from last.ckpt: the same weights and step as 4 epochs straight (<= 1e-6)."""
    base = [*SMALL, "model.optimizer=adam", "model.lr=0.01"]
    train(compose_cfg(*base, "trainer.max_epochs=4"), tmp_path / "straight")
    train(compose_cfg(*base, "trainer.max_epochs=2"), tmp_path / "first")
    ckpt = tmp_path / "first/checkpoints/last.ckpt"
    train(compose_cfg(*base, "trainer.max_epochs=4", f"ckpt_path={ckpt}"), tmp_path / "resumed")
    straight = torch.load(tmp_path / "straight/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 4 * ((1005 - 2 * 100) // 64)
    assert (
        max_diff(
            weights(tmp_path / "straight/checkpoints/last.ckpt"), weights(tmp_path / "resumed/checkpoints/last.ckpt")
        )
        <= 1e-6
    )


def test_bad_setting_raises_before_any_output(tmp_path):
    with pytest.raises(ConfigError, match="data.batch_size=0 is invalid"):
        train(compose_cfg(*SMALL, "data.batch_size=0"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_trainer_flag_errors_become_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer.precision='bogus' is invalid: .*precision") as err:
        train(compose_cfg(*SMALL, "trainer.precision=bogus"), tmp_path)
    assert "\n" not in str(err.value)


def test_last_ckpt_is_the_last_epoch_even_when_it_is_not_the_best(tmp_path):
    """With a learning rate of ~0 val/loss never improves after epoch 0: best.ckpt stays there, last.ckpt moves on
    (Lightning 2.6's save_last=True would leave last.ckpt at the best epoch, and resuming would lose epochs)."""
    train(compose_cfg(*SMALL, "model.lr=1e-12"), tmp_path)
    best = torch.load(tmp_path / "checkpoints/best.ckpt", weights_only=True)
    last = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)
    assert best["epoch"] == 0 and last["epoch"] == 2
    assert last["global_step"] == 3 * ((1005 - 200) // 64)
