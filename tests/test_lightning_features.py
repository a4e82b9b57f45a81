"""Lightning's own features, reached through dpddp: each is supported or refused in one line before anything is
written, tested by kind: a callback that needs a part the run does not have (a logger), a checkpoint that cannot
continue a run (weights only, another model's, truncated), a Trainer mode that switches off what the outputs rely
on, a framework's advice that does not apply to this project (Lightning's strategy names, its fix for an unused
parameter)."""

import csv
import inspect
import json
import logging
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, ROOT, cli_config, compose_cfg, leftover, run_cli, run_train
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import LearningRateMonitor
from torch import nn

from dpddp._compat import registered_strategies
from dpddp.entry.command_line import unknown_option
from dpddp.entry.hydra import StartChecks
from dpddp.errors import ConfigError
from dpddp.models.linear import LinearClassifier
from dpddp.parallel.ddp import UNUSED_PARAMETERS_LINE
from dpddp.parallel.rules import STRATEGIES, lightning_equivalent
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


def test_the_lightning_cli_says_a_callback_that_needs_a_logger_in_its_own_options():
    with pytest.raises(ConfigError) as err:
        check_config(cli_config("--trainer.callbacks+=LearningRateMonitor", "--trainer.accelerator=cpu"))
    assert str(err.value) == (
        "--trainer.callbacks (LearningRateMonitor) needs a logger, and the run has none: add "
        "--trainer.logger=CSVLogger --trainer.logger.save_dir=. (or TensorBoardLogger, MLFlowLogger, WandbLogger), "
        "or drop the callback"
    )
    given = ("--trainer.logger=CSVLogger", "--trainer.logger.save_dir=.")
    check_config(cli_config("--trainer.callbacks+=LearningRateMonitor", "--trainer.accelerator=cpu", *given))


def test_a_rank_that_opens_no_tracker_run_has_a_logger_for_the_callbacks_that_need_one(tmp_path, monkeypatch):
    """Under a tracker only rank 0 builds it; the others get a logger that logs nothing (tests/test_trackers.py
    runs LearningRateMonitor so on ddp(2))."""
    from lightning.pytorch.loggers.logger import DummyLogger

    from dpddp.parallel.rules import world_of
    from dpddp.run.assembly import _build_logger

    monkeypatch.setenv("RANK", "1")
    cfg, none = compose_cfg("logger=mlflow"), compose_cfg("logger=none")
    (logger,) = _build_logger(cfg, tmp_path, world_of(cfg))
    assert isinstance(logger, DummyLogger)
    assert _build_logger(none, tmp_path, world_of(none)) is False
    assert list(tmp_path.iterdir()) == []


def test_a_learning_rate_monitor_with_a_logger_logs_the_learning_rate(tmp_path):
    lr = "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"
    train(compose_cfg(*SMALL, lr, "+callbacks.lr.logging_interval=epoch", "logger=csv", "model.lr=0.05"), tmp_path)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("lr-SGD")]
    assert [float(row["lr-SGD"]) for row in rows] == [0.05]


# -- a checkpoint that cannot continue a run ------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A one-epoch run's directory: its checkpoints/last.ckpt, and wo.ckpt from a ModelCheckpoint that saves the
    weights only."""
    run = tmp_path_factory.mktemp("first")
    wo = "+callbacks.wo._target_=lightning.pytorch.callbacks.ModelCheckpoint"
    train(compose_cfg(*SMALL, wo, "+callbacks.wo.save_weights_only=true", "+callbacks.wo.filename=wo"), run)
    return run


def _refusal(*overrides: str, stage: str = "fit") -> str:
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(*SMALL, *overrides), stage)
    return str(err.value)


def test_a_weights_only_checkpoint_cannot_continue_a_fit_and_is_one_line(first_run, tmp_path, capsys):
    wo = first_run / "checkpoints" / "wo.ckpt"
    assert _refusal(f"ckpt_path={wo}", "trainer.max_epochs=4") == (
        f"ckpt_path={str(wo)!r} holds the model's weights only (no optimizer_states or callback states: saved with "
        f"weights_only=True), so a fit cannot continue from it: continue from ckpt_path={wo.parent / 'last.ckpt'}, "
        "or load the weights in the model yourself and start without ckpt_path"
    )
    alone = tmp_path / "alone" / "wo.ckpt"  # no last.ckpt beside it
    alone.parent.mkdir()
    alone.write_bytes(wo.read_bytes())
    assert _refusal(f"ckpt_path={alone}").endswith(
        "continue from a full checkpoint (its run's checkpoints/last.ckpt), or load the weights in the model "
        "yourself and start without ckpt_path"
    )
    alone.unlink()
    alone.parent.rmdir()
    check_config(compose_cfg(*SMALL, f"ckpt_path={wo}"), "test")  # testing the weights needs nothing more
    with pytest.raises(SystemExit) as stop:  # train.py: before Hydra makes the run directory
        StartChecks().on_run_start(compose_cfg(*SMALL, f"ckpt_path={wo}", f"hydra.run.dir={tmp_path / 'run'}"))
    assert stop.value.code == 2 and capsys.readouterr().err.startswith(f"error: ckpt_path={str(wo)!r} holds the")
    assert list(tmp_path.iterdir()) == []
    check_config(compose_cfg(*SMALL, f"ckpt_path={first_run / 'checkpoints/last.ckpt'}", "trainer.max_epochs=4"))


@pytest.mark.parametrize(
    "overrides,other,trained",
    [
        (["data.num_features=12"], "linear.weight is [4, 16] there, [4, 12] here", " (data.num_features=16)"),
        (
            ["data.num_classes=3"],
            "linear.weight is [4, 16] there, [3, 16] here; linear.bias is [4] there, [3] here",
            " (data.num_classes=4)",
        ),
        (
            ["model=mlp"],
            "no net.0.weight, net.0.bias, net.2.weight; an unknown linear.weight, linear.bias",
            "",  # another model: its settings are not this one's
        ),
    ],
    ids=["other sizes", "other classes", "another model"],
)
@pytest.mark.parametrize("stage", ["fit", "test"])
def test_another_models_checkpoint_is_one_line_naming_what_differs(first_run, overrides, other, trained, stage):
    last = first_run / "checkpoints" / "last.ckpt"
    assert _refusal(f"ckpt_path={last}", "trainer.max_epochs=4", *overrides, stage=stage) == (
        f"ckpt_path={str(last)!r} holds another model's weights ({other}): give a checkpoint of this model, or the "
        f"model settings it was trained with{trained}"
    )


def test_a_truncated_checkpoint_is_one_line(first_run, tmp_path):
    whole = (first_run / "checkpoints" / "last.ckpt").read_bytes()
    cut = tmp_path / "last.ckpt"
    cut.write_bytes(whole[: len(whole) // 2])
    line = _refusal(f"ckpt_path={cut}", "trainer.max_epochs=4")
    assert line.startswith(f"ckpt_path={str(cut)!r} cannot be read as a checkpoint (") and line.endswith(
        "): give a last.ckpt or best.ckpt written by dpddp"
    )


# -- a Trainer mode that switches off what the outputs rely on ------------------------------------------------

MODES = [
    (
        ["trainer.barebones=true"],
        "trainer.barebones=True is not offered: Lightning switches off self.log() and checkpointing in it, and "
        "dpddp's outputs are made of them (metrics.json, the epoch lines, last.ckpt): for speed use "
        "trainer.enable_progress_bar=false epoch_lines=false logger=none instead",
    ),
    (  # the line the case saw after the run directory was written, with the checkpoints dropped: now the same one
        ["trainer.barebones=true", "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null"],
        "trainer.barebones=True is not offered: Lightning switches off self.log() and checkpointing in it",
    ),
    (
        ["+trainer.logger=false"],
        "trainer.logger is not set in the trainer group: choose a logger group: logger=csv|tensorboard|mlflow|"
        "wandb|none",
    ),
    (
        ["trainer.enable_checkpointing=false"],
        "trainer.enable_checkpointing=False cannot be kept with callbacks.model_checkpoint, callbacks.last_checkpoint "
        "(ModelCheckpoint callbacks): drop them too for a run that saves no checkpoint and cannot be continued",
    ),
]


@pytest.mark.parametrize("overrides,line", MODES, ids=[" ".join(o) for o, _ in MODES])
@pytest.mark.parametrize("strategy", [[], ["strategy=ddp", "devices=2"]], ids=["one process", "ddp(2)"])
def test_a_trainer_mode_that_switches_off_the_outputs_is_one_line(overrides, line, strategy):
    assert _refusal(*strategy, *overrides).startswith(line)


def test_barebones_is_refused_by_the_lightning_cli_before_its_run_directory(tmp_path, monkeypatch):
    from dpddp.entry.lightning_cli import _parsed

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^trainer\.barebones=True is not offered: "):
        _parsed("fit", ["--trainer.barebones=true", "--trainer.accelerator=cpu"])
    assert list(tmp_path.iterdir()) == []


# -- a framework's advice that does not apply to this project -------------------------------------------------

LIGHTNING_NAMES = sorted(set(registered_strategies()) - set(STRATEGIES))


def test_lightnings_strategy_names_are_known_to_the_check():
    mapped = {name for name in LIGHTNING_NAMES if lightning_equivalent(name) is not None}
    assert {"ddp_find_unused_parameters_true", "ddp_spawn_find_unused_parameters_true", "ddp_fork"} <= mapped
    assert {"fsdp", "deepspeed", "xla"} <= set(LIGHTNING_NAMES) - mapped
    assert unknown_option(["strategy=ddp_find_unused_parameters_true"]) == (
        "strategy=ddp_find_unused_parameters_true is Lightning's name for DDPStrategy(find_unused_parameters=True, "
        "start_method='popen'): use strategy=ddp strategy.find_unused_parameters=true"
    )
    assert unknown_option(["strategy=single_device"]) == (
        "strategy=single_device is Lightning's name for SingleDeviceStrategy(): use strategy=auto"
    )


@pytest.mark.parametrize("name", LIGHTNING_NAMES)
def test_each_lightning_strategy_name_is_mapped_to_dpddps_settings_or_refused_naming_them(name):
    """Each name is one line, from the command line (before Hydra) and from ``strategy.name=``; a mapped name's
    settings pass the check and set what Lightning's name sets."""
    cls, params = registered_strategies()[name]
    line = unknown_option([f"strategy={name}"])
    assert line is not None and "\n" not in line
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("accelerator=cpu", f"strategy.name={name}"))
    assert str(err.value) == line
    settings = lightning_equivalent(name)
    if settings is None:
        assert line == (
            f"strategy={name} ({cls.__name__}) is not offered (dpddp keeps its promises with its own strategies: "
            "auto, dp, ddp, ddp_spawn): use strategy=ddp, or strategy=dp on GPUs"
        )
        return
    assert line.endswith(f"): use {' '.join(settings)}")
    devices = "devices=1" if settings == ("strategy=auto",) else "devices=2"
    cfg = compose_cfg("accelerator=cpu", devices, *settings)
    check_config(cfg)
    if cfg.strategy.name != "auto":
        assert cfg.strategy.find_unused_parameters is params.get("find_unused_parameters", False)
        start = params.get("start_method", "popen")
        assert (cfg.strategy.name, cfg.strategy.launch) == {
            "popen": ("ddp", "auto"),
            "spawn": ("ddp_spawn", "exec"),
            "fork": ("ddp", "fork"),
        }[start]


def test_the_lightning_cli_takes_lightnings_strategy_names_as_dpddps_settings():
    cfg = cli_config("--trainer.strategy=ddp_find_unused_parameters_true", "--trainer.devices=2")
    assert (cfg.strategy.name, cfg.strategy.find_unused_parameters, cfg.devices) == ("ddp", True, 2)
    cfg = cli_config("--trainer.strategy=ddp_fork", "--trainer.devices=2")
    assert (cfg.strategy.name, cfg.strategy.launch, cfg.strategy.find_unused_parameters) == ("ddp", "fork", False)
    with pytest.raises(ConfigError) as err:
        cli_config("--trainer.strategy=deepspeed")
    assert str(err.value) == (
        "--trainer.strategy=deepspeed (DeepSpeedStrategy) is not offered (dpddp keeps its promises with its own "
        "strategies: auto, dp, ddp, ddp_spawn): use --trainer.strategy=ddp, or --trainer.strategy=dp on GPUs"
    )


class UnusedLayerClassifier(LinearClassifier):
    """The linear classifier with a layer that takes no part in the loss."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.unused = nn.Linear(2, 2)


@pytest.mark.slow
def test_an_unused_parameter_under_ddp_is_one_line_naming_dpddps_setting_and_that_setting_runs(tmp_path):
    args = [
        "accelerator=cpu",
        "strategy=ddp",
        "devices=2",
        "data.num_samples=606",
        "trainer.max_epochs=1",
        "model._target_=test_lightning_features.UnusedLayerClassifier",
    ]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    failed = run_train(*args, "hydra.run.dir=failed", cwd=tmp_path, env=env)
    said = (failed.stdout + failed.stderr).splitlines()
    lines = [line[line.index("error: ") :] for line in said if "error: " in line]
    assert failed.returncode == 1 and lines and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    for line in lines:  # each rank's, and rank 0's for the run: the cause and dpddp's setting, whole
        assert re.fullmatch(rf"error: rank \d.*{re.escape(UNUSED_PARAMETERS_LINE)}\)?", line), line
    run_train(*args, "strategy.find_unused_parameters=true", "hydra.run.dir=ok", cwd=tmp_path, env=env, check=True)
    cli = ["fit", "--model=test_lightning_features.UnusedLayerClassifier", "--trainer.accelerator=cpu"]
    cli += ["--trainer.devices=2", "--trainer.max_epochs=1", "--data.num_samples=606"]
    # the line's CLI spelling runs (the CLI's --trainer.strategy=ddp fails as train.py's run above: the same
    # strategy's line; a rank's failure through the CLI is test_faults' test_killing_rank_1_ends_the_run[cli])
    proc = run_cli(*cli, "--trainer.strategy=ddp_find_unused_parameters_true", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert UNUSED_PARAMETERS_LINE not in proc.stderr + proc.stdout and leftover(proc.tag) == []


# -- a data module of the user's own through the CLI ---------------------------------------------------------

PLAIN = ("--model=dpddp.models.mlp.MLPClassifier", "--model.num_features=4", "--model.num_classes=3")


def test_the_cli_takes_a_plain_data_module_whose_batch_size_has_another_name(tmp_path, monkeypatch):
    """Case 56: throughput counts the samples each batch holds (its first dimension), not a data module's
    attribute: 2 epochs of 101 samples in batches of 12 (the short last one in) are 202 samples; under ddp such
    a module is one line before the fit, naming the wrapper that shards it."""
    from dpddp.entry.lightning_cli import main

    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        main(["fit", *PLAIN, "--data=users_models.PlainData", "--trainer.max_epochs=2", "--trainer.accelerator=cpu",
              "--trainer.enable_progress_bar=false"])  # fmt: skip
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
    run = tmp_path / "lightning_logs" / "version_0"
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0 < metrics["samples_per_sec"] < float("inf") and metrics["test/acc"] is not None
    counts = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["dpddp"]["throughput"]
    assert counts["fallback_samples"] == 202
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert all(float(row["samples_per_sec"]) > 0 for row in rows if row["stage"] == "fit")
    with pytest.raises(ConfigError) as err:
        check_config(
            cli_config(*PLAIN, "--data=users_models.PlainData", "--trainer.strategy=ddp", "--trainer.devices=2")
        )
    assert str(err.value).startswith("data._target_=users_models.PlainData would give each of 2 processes every batch")
