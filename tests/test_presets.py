"""debug/ presets, the config-tree switch, and more than one logger at once."""

import logging

import pytest
import torch
from conftest import QUIET, compose_cfg, metrics, run_train
from omegaconf import OmegaConf

from dpddp.errors import ConfigError
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


# The lightning-hydra-template's preset names: callbacks= adds its callback to the default ones (a list adds
# several), trainer= sets dpddp's top-level knobs (the Trainer flags stay trainer/default's).
DEFAULT_CALLBACKS = ["last_checkpoint", "metric_contract", "model_checkpoint"]
CALLBACKS = {
    "early_stopping": [*DEFAULT_CALLBACKS, "early_stopping"],
    "swa": [*DEFAULT_CALLBACKS, "swa"],
    "ema": [*DEFAULT_CALLBACKS, "ema"],
    "lr_monitor": [*DEFAULT_CALLBACKS, "lr_monitor"],
    "model_checkpoint": ["last_checkpoint", "model_checkpoint"],
    "none": [],
    "[early_stopping,lr_monitor]": [*DEFAULT_CALLBACKS, "early_stopping", "lr_monitor"],
}


@pytest.mark.parametrize("preset", CALLBACKS)
def test_callbacks_presets_compose_to_their_callbacks(preset):
    cfg = compose_cfg(f"callbacks={preset}", "logger=csv")
    check_config(cfg)
    assert sorted(k for k, v in (cfg.callbacks or {}).items() if v is not None) == sorted(CALLBACKS[preset])


def test_trainer_presets_set_the_top_level_knobs():
    knobs = {
        "trainer=cpu": ("auto", "cpu", 1),
        "trainer=gpu": ("auto", "gpu", 1),
        "trainer=ddp": ("ddp", "auto", 2),
        "trainer=ddp_sim": ("ddp", "cpu", 2),
    }
    for preset, (strategy, accelerator, devices) in knobs.items():
        cfg = compose_cfg(preset)
        assert (cfg.strategy.name, cfg.accelerator, cfg.devices) == (strategy, accelerator, devices), preset
        assert cfg.trainer == compose_cfg().trainer and "max_epochs" not in cfg, preset  # the flags stay trainer's
    assert compose_cfg("trainer=ddp", "devices=3").devices == 3  # the command line wins over the preset
    assert compose_cfg("trainer=ddp_sim", "strategy=auto").strategy.name == "auto"
    same = OmegaConf.to_yaml(compose_cfg("trainer=ddp", "devices=2"))
    assert same == OmegaConf.to_yaml(compose_cfg("strategy=ddp", "devices=2"))
    check_config(compose_cfg("trainer=ddp_sim"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="accelerator=gpu"):
            check_config(compose_cfg("trainer=gpu"))


def test_a_misspelled_preset_gets_the_nearest_name():
    from dpddp.entry.command_line import unknown_option

    assert unknown_option(["callbacks=early_stoping"]).startswith(
        "callbacks=early_stoping is unknown (did you mean early_stopping?): choose one of default, early_stopping"
    )
    assert unknown_option(["trainer=dpp"]).startswith("trainer=dpp is unknown (did you mean ddp?)")
    assert unknown_option(["callbacks=[early_stopping,lr_monitr]"]).startswith(
        "callbacks=lr_monitr is unknown (did you mean lr_monitor?)"
    )
    assert unknown_option(["callbacks=[early_stopping,lr_monitor]"]) is None


TINY = [*QUIET, "accelerator=cpu", "data.num_samples=400", "trainer.max_epochs=2", "steps_per_execution=1"]


@pytest.mark.parametrize(
    "overrides",
    [
        ("callbacks=early_stopping", "callbacks.early_stopping.min_delta=9", "trainer.max_epochs=5"),
        ("callbacks=swa", "callbacks.swa.swa_epoch_start=1"),
        ("callbacks=ema",),
        ("callbacks=lr_monitor", "logger=csv"),
        ("callbacks=model_checkpoint",),
        ("callbacks=[early_stopping,lr_monitor]", "logger=csv"),
        ("trainer=cpu",),
    ],
)
def test_each_preset_trains_on_one_process(tmp_path, overrides):
    """Each preset's callbacks are in ``last.ckpt`` (Lightning keeps each one's state there, by its class name)."""
    train(compose_cfg(*TINY, *overrides), tmp_path)
    ckpt = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=False)
    kept = {name.split("{")[0] for name in ckpt["callbacks"]}
    expected = {
        "callbacks=early_stopping": "EarlyStopping",
        "callbacks=swa": "StochasticWeightAveraging",
        "callbacks=ema": "EMAWeightAveraging",
        "callbacks=model_checkpoint": "ModelCheckpoint",
        "trainer=cpu": "ModelCheckpoint",
    }
    assert expected.get(overrides[0], "ModelCheckpoint") in kept, kept
    if overrides[0] == "callbacks=early_stopping":  # min_delta=9: only the first validation improves; patience 3
        stopping = next(state for name, state in ckpt["callbacks"].items() if name.startswith("EarlyStopping"))
        assert stopping["stopped_epoch"] == 3 and stopping["wait_count"] == 3  # 4 epochs of max_epochs=5
    if "lr_monitor" in overrides[0]:
        assert "lr-SGD" in (tmp_path / "csv/version_0/metrics.csv").read_text().splitlines()[0]
    assert (tmp_path / "metrics.json").is_file()


def test_callbacks_none_trains_without_configured_callbacks(tmp_path):
    result = train(compose_cfg(*TINY, "callbacks=none"), tmp_path)
    assert result["test/acc"] > 0.25  # it trained and tested (chance is 0.25)
    assert not (tmp_path / "checkpoints/last.ckpt").exists() and not (tmp_path / "checkpoints/best.ckpt").exists()


@pytest.mark.slow
def test_trainer_ddp_equals_strategy_ddp(tmp_path):
    """``trainer=ddp devices=2`` is ``strategy=ddp devices=2``: the same config, every key resolved (so the same
    2-process run), and it runs on 2 processes; ``trainer=ddp_sim callbacks=none`` keeps promise 1 (its metrics are
    one process's)."""
    args = ["accelerator=cpu", "data.num_samples=400", "trainer.max_epochs=1", "devices=2"]
    preset_cfg, knobs_cfg = (compose_cfg(choice, *args) for choice in ("trainer=ddp", "strategy=ddp"))
    assert OmegaConf.to_container(preset_cfg, resolve=True) == OmegaConf.to_container(knobs_cfg, resolve=True)
    run_train("trainer=ddp", *args, "hydra.run.dir=preset", cwd=tmp_path, check=True)
    preset = metrics(tmp_path / "preset")
    assert preset["world_size"] == 2 and preset["strategy"] == "ddp"
    # trainer=ddp_sim (2 CPU processes) with callbacks=none: no checkpoint, and the metrics of one process
    run_train("trainer=ddp_sim", "callbacks=none", *args[:-1], "hydra.run.dir=sim", cwd=tmp_path, check=True)
    one = train(compose_cfg(*QUIET, *args[:-1], "callbacks=none"), tmp_path / "one")
    assert metrics(tmp_path / "sim")["world_size"] == 2 and not (tmp_path / "sim/checkpoints/last.ckpt").exists()
    for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert metrics(tmp_path / "sim")[key] == pytest.approx(one[key], abs=1e-5), key
