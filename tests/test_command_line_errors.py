"""Errors in the command line and the file system end in one ``error:`` line, exit 2, nothing lost: an interpolation
that does not resolve (in an override or a config), an override the composed config refuses (a misspelled or
absent key without ``+``, in one run or one job of a sweep), Hydra modes that cannot be combined, a run or sweep
directory that cannot be written, and a checkpoint that cannot be written (the earlier one stays whole). A sweep
records a bad job and goes on; ``metrics.json`` keeps the overrides as typed."""

import csv
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF, QUIET, ROOT, child_env, cli_here, compose_cfg, metrics, run_train, train_py_here
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import OmegaConf, open_dict

from dpddp._compat import hydra_override_refused
from dpddp.cluster import refuse_non_integer_variables
from dpddp.continuity.io import AtomicCheckpointIO
from dpddp.entry import hydra as hydra_entry
from dpddp.entry.command_line import (
    mode_conflict,
    refused_override,
    sweep_variants,
    unknown_option,
    unreadable_override,
)
from dpddp.entry.hydra import StartChecks
from dpddp.errors import ConfigError, WriteFailed, unwritable
from dpddp.run.build import build
from dpddp.run.config import check_config, check_output_dir, check_resolvable
from dpddp.run.keys import TOP_LEVEL_KEYS
from dpddp.run.training import train

ONE = ["accelerator=cpu", "data.num_samples=606", "trainer.max_epochs=1"]
READ_ONLY = ("Read-only file system", "Permission denied")  # a read-only mount (root), or a mode without w


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- interpolations ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "model.lr=${nope}",
            "model.lr='${nope}' cannot be resolved (Interpolation key 'nope' not found): give a value, or interpolate "
            "a key that exists (e.g. ${data.num_features})",
        ),
        (
            "data.batch_size=${oc.env:DPDDP_NOPE_UNSET}",
            "data.batch_size='${oc.env:DPDDP_NOPE_UNSET}' cannot be resolved (Environment variable "
            "'DPDDP_NOPE_UNSET' not found): set DPDDP_NOPE_UNSET in the environment, or give a default: "
            "${oc.env:DPDDP_NOPE_UNSET,<default>}",
        ),
        (
            "trainer.max_epochs=x${data.nope}",
            "trainer.max_epochs='x${data.nope}' cannot be resolved (Interpolation key 'data.nope' not found): give a "
            "value, or interpolate a key that exists (e.g. ${data.num_features})",
        ),
        (
            "data=dataset",  # a data config without the sizes the default model follows
            "model.num_features='${data.num_features}' cannot be resolved (Interpolation key 'data.num_features' not "
            "found): the data has no num_features to follow: give the model's sizes (model.num_features=<features "
            "per sample> model.num_classes=<classes>), or, for a class that takes neither, give model a yaml of its "
            "own (conf/model/<name>.yaml)",
        ),
    ],
)
def test_an_interpolation_that_does_not_resolve_is_one_line_naming_the_key_as_typed(override, line):
    cfg = compose_cfg("accelerator=cpu", override)
    with pytest.raises(ConfigError) as err:
        check_resolvable(cfg)
    assert str(err.value) == line


def test_interpolations_that_resolve_pass_and_a_list_item_is_named_by_its_index(monkeypatch):
    monkeypatch.setenv("DPDDP_TEST_LR", "0.05")
    check_resolvable(compose_cfg("accelerator=cpu", "model.lr=${oc.env:DPDDP_TEST_LR}"))  # packaged ones too
    cfg = compose_cfg("accelerator=cpu")
    with open_dict(cfg):
        cfg.callbacks.x = OmegaConf.create({"items": [1, "${oc.env:DPDDP_NOPE_UNSET}"]})
    with pytest.raises(ConfigError, match=r"^callbacks\.x\.items\[1\]='\$\{oc\.env:DPDDP_NOPE_UNSET\}' cannot be"):
        check_resolvable(cfg)


# -- overrides the composed config refuses ------------------------------------------------------------------


class Refused(Exception):
    """The line ``refused_override`` made, raised out of Hydra's composition."""


def _refused_line(*overrides: str) -> str | None:
    """The line for the first of ``overrides`` the composed config refuses, or ``None`` when it composes."""

    def refuse(override, cfg, err):
        raise Refused(refused_override(override, cfg, err))

    try:
        with hydra_override_refused(refuse):
            compose_cfg(*overrides)
    except Refused as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["devises=2"], "devises=2: the config has no key devises: did you mean devices?"),
        # where the run's key check would refuse +key=value too, its advice instead (one hop, one source)
        (
            ["data.num_workers=2"],  # a key of another option of the group
            "data.num_workers=2: the config has no key data.num_workers (the chosen data config has none; "
            "data=dataset has one): did you mean data.num_features?",
        ),
        (
            ["trainer.max_epoch=2"],
            "trainer.max_epoch=2: the config has no key trainer.max_epoch: did you mean trainer.max_epochs?",
        ),
        (
            ["data=digits", "data.label_noise=0.1"],  # a key of another option the chosen class does not take
            "data.label_noise=0.1: the config has no key data.label_noise (the chosen data config has none; "
            "data=default has one): dpddp.data.tables.TableDataModule takes no label_noise (of the packaged config): "
            "give data a yaml of its own (conf/data/<name>.yaml)",
        ),
        (
            ["data=dataset", "data.dataset._target_=x.Y"],  # the chosen option has the section, not the key
            "data.dataset._target_=x.Y: the config has no key data.dataset._target_: give a key it has, or add a new "
            "one with +data.dataset._target_=x.Y",
        ),
        (
            ["trainer.accelerator=cpu"],
            "trainer.accelerator=cpu: the config has no key trainer.accelerator: set it at the top level: "
            "accelerator=cpu",
        ),
        (
            ["data=digits", "trainr.max_epochs=1"],
            "trainr.max_epochs=1: the config has no key trainr.max_epochs: did you mean trainer.max_epochs?",
        ),
        (["nothing_like_it=1"], "nothing_like_it=1: the config has no key nothing_like_it: valid keys: accelerator,"),
        # a section the key check leaves alone: the addition is taken, so it is the advice
        (
            ["logger.foo=1"],
            "logger.foo=1: the config has no key logger.foo: give a key it has, or add a new one with +logger.foo=1",
        ),
        # a key the check takes, with a value it refuses: the check's refusal at once, not the +key fix
        (
            ["strategy.start_method=spawn"],
            "strategy.start_method='spawn' is not offered: dpddp starts the ranks itself; remove it and choose "
            "strategy.launch=fork (CPU) or exec (a fresh interpreter per rank, as strategy=ddp_spawn does)",
        ),
        (["strategy.launch=x"], "strategy.launch='x' is unknown: use auto, fork (CPU) or exec"),  # on auto
        (["~nope"], "~nope: the config has no nope to delete: drop it, or give a key it has"),
        (["~seed=3"], "~seed=3: seed is 0, not 3: write ~seed to delete it whatever its value"),
        (["+seed=3"], "+seed=3: the config already has seed: set it with seed=3 (or ++seed=3: add or set)"),
        (
            ["hydra.job.chdir=abc"],
            "hydra.job.chdir=abc cannot be applied (Value 'abc' is not a valid bool (type str)): give "
            "hydra.job.chdir a value it takes",
        ),
    ],
)
def test_an_override_the_composed_config_refuses_is_one_line_naming_it_the_nearest_key_and_the_fix(overrides, line):
    said = _refused_line(*overrides)
    assert said.startswith(line)
    if overrides[-1] in (
        "data.num_workers=2",
        "trainer.max_epoch=2",
        "trainer.accelerator=cpu",
        "data.label_noise=0.1",
    ):
        assert said == line  # the whole line: the advice the run's key check gives, and no other
    if (
        "has no key" in said and "add a new one with +" not in said
    ):  # the addition is refused by the run's key check: never suggested
        with pytest.raises(ConfigError):
            check_config(compose_cfg(*overrides[:-1], f"+{overrides[-1]}", "accelerator=cpu"))


def test_overrides_hydra_accepts_are_not_refused_and_plus_plus_adds_silently_as_in_hydra():
    assert _refused_line("++devises=2", "+extra=1", "~seed", "data=dataset", "data.num_workers=2") is None
    assert compose_cfg("++devises=2").devises == 2


@pytest.mark.parametrize(
    "overrides,variants",
    [
        (
            ["data=default,digits", "seed=0,1", "model.lr=0.5"],
            [["data=default", "seed=0", "model.lr=0.5"], ["data=digits", "seed=0", "model.lr=0.5"]],
        ),
        (["seed=0,1", "seed=2,3"], [["seed=2"]]),  # a key given twice: its last values, as Hydra's sweeper
        (["seed=1"], []),  # one job: the sweep's own composition applied its overrides
        (["hparams_search=optuna", "seed=0,1"], []),  # Optuna's own trials
    ],
)
def test_a_sweep_checks_its_first_job_of_each_group_option_before_it_starts(overrides, variants):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = GlobalHydra.instance().config_loader().load_configuration("config", overrides, RunMode.MULTIRUN)
        assert sweep_variants(cfg) == variants


@pytest.mark.parametrize(
    "override,line",
    [
        ("devices=0", "devices=0 is invalid: use a positive number of devices per node, or -1 for all GPUs"),
        ("model.lr=-1", "model.lr=-1 is invalid: use a learning rate in [1e-12, 1000], e.g. model.lr=0.1"),
        ("model.lr=1e6", "model.lr=1000000.0 is invalid: use a learning rate in [1e-12, 1000], e.g. model.lr=0.1"),
        ("trainer.max_epochs=0", "trainer.max_epochs=0 is invalid: use a positive number (0 trains nothing), or -1"),
        ("trainer.max_epochs=-5", "trainer.max_epochs=-5 is invalid: use a positive number (0 trains nothing), or -1"),
        ("+data.nope=1", "unknown setting data.nope: valid keys: "),
        ("resume=maybe", "resume='maybe' is not a switch: use resume=true or resume=false"),
        ("predict=1", "predict=1 is not a switch: use predict=true or predict=false"),
        ("epoch_lines=sometimes", "epoch_lines='sometimes' is invalid: use auto (if stdout is not a tty), true or"),
        # values only Lightning's Trainer knows to be wrong: its own rule, before anything is made
        ("trainer.precision=17", "trainer.precision=17 is invalid: pl.Trainer takes 64, 32, 16, 'transformer-engine'"),
        ("trainer.deterministic=maybe", "trainer.deterministic='maybe' is invalid: pl.Trainer takes bool, 'warn' or"),
        ("trainer.num_sanity_val_steps=abc", "trainer.num_sanity_val_steps='abc' is invalid: pl.Trainer takes int"),
        ("trainer.check_val_every_n_epoch=0", "trainer.check_val_every_n_epoch=0 is invalid: use a positive number of"),
        ("trainer.max_time=garbage", "trainer.max_time='garbage' is invalid: `Timer(duration='garbage')` is not"),
        (
            "trainer.gradient_clip_algorithm=foo",
            "trainer.gradient_clip_algorithm='foo' is invalid: `gradient_clip_algorithm` foo is invalid. Allowed "
            "algorithms: ['value', 'norm'].",
        ),
        ("trainer.profiler=nope", "trainer.profiler='nope' is invalid: When passing string value for the `profiler`"),
        ("trainer.limit_val_batches=-2", "trainer.limit_val_batches=-2 is invalid: You have passed invalid value -2"),
        (
            "trainer.enable_checkpointing=false",
            "trainer.enable_checkpointing=False cannot be kept with callbacks.model_checkpoint, "
            "callbacks.last_checkpoint (ModelCheckpoint callbacks): drop them too for a run that saves no checkpoint "
            "and cannot be continued (callbacks.model_checkpoint=null callbacks.last_checkpoint=null), or remove "
            "trainer.enable_checkpointing",
        ),
        (
            "trainer.barebones=true",
            "trainer.barebones=True is not offered: Lightning switches off self.log() and checkpointing in it, and "
            "dpddp's outputs are made of them (metrics.json, the epoch lines, last.ckpt): for speed use "
            "trainer.enable_progress_bar=false epoch_lines=false logger=none instead",
        ),
        # a callback that needs a part the run does not have
        (
            "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
            "callbacks.lr (LearningRateMonitor) needs a logger, and logger=none: use logger=csv (or tensorboard, "
            "mlflow, wandb), or drop it with callbacks.lr=null",
        ),
    ],
)
def test_a_bad_setting_ends_train_py_before_hydra_makes_the_run_directory_and_is_the_only_line(
    tmp_path, capsys, override, line
):
    """``StartChecks.on_run_start`` (before Hydra writes ``.hydra/`` and ``train.log`` and logs the invocation)
    runs the run's config check: its line is all that is said."""
    cfg = compose_cfg("accelerator=cpu", override, f"hydra.run.dir={tmp_path / 'run'}")
    with pytest.raises(SystemExit) as stop:
        StartChecks().on_run_start(cfg)
    (said,) = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and said.startswith(f"error: {line}") and list(tmp_path.iterdir()) == []


def _hydra_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", ["accelerator=cpu", *overrides], return_hydra_config=True)


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["resume=true"], "ckpt_path='{run}/checkpoints/last.ckpt' cannot be read as a checkpoint"),
        (["seed=1"], "the run directory {run} holds another run (last.ckpt, metrics.json): continue it with resume"),
        (["resume=true", "data.num_samples=2000"], "ckpt_path='{run}/checkpoints/last.ckpt' was trained with other"),
    ],
)
def test_a_run_its_directory_refuses_is_one_line_and_writes_nothing_into_that_directory(
    tmp_path, capsys, overrides, line
):
    """What the run directory holds is judged before Hydra writes ``.hydra-N/`` and ``train.log`` into it: a
    resume's checkpoint (unreadable; trained with other data), another run's outputs."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if "data.num_samples=2000" in overrides:
        ckpt = {"state_dict": {}, "datamodule_hyper_parameters": {"num_samples": 4096}}
        torch.save(ckpt, run / "checkpoints/last.ckpt")
    else:
        (run / "checkpoints/last.ckpt").write_bytes(b"")
    (run / "metrics.json").write_text("{}")
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        StartChecks().on_run_start(_hydra_cfg(*overrides, f"hydra.run.dir={run}"))
    (said,) = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and said.startswith("error: " + line.format(run=run)), said
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_resume_without_the_run_directory_is_one_line_and_makes_none(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        StartChecks().on_run_start(_hydra_cfg("resume=true"))
    (said,) = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and said.startswith("error: resume=true needs the run to resume: add hydra.run.dir=")
    assert list(tmp_path.iterdir()) == []


def test_lightnings_check_of_valid_trainer_flags_says_nothing_and_no_checkpointing_is_a_run_without_one(
    tmp_path, capfd
):
    """The bare Trainer that checks the flags is silent (the run's own Trainer says its lines); the advised
    ``trainer.enable_checkpointing=false`` with the ModelCheckpoints dropped passes and builds no
    ModelCheckpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dpddp.run.assembly import build_trainer

    check_config(compose_cfg("accelerator=cpu", "trainer.precision=16-mixed", "trainer.gradient_clip_val=1.0"))
    assert capfd.readouterr() == ("", "")
    off = ["trainer.enable_checkpointing=false", "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null"]
    cfg = compose_cfg("accelerator=cpu", *off)
    trainer = build_trainer(cfg, check_config(cfg).world, tmp_path)
    assert not any(isinstance(cb, ModelCheckpoint) for cb in trainer.callbacks)  # type: ignore[attr-defined]


SIZES = ("model.num_features=16", "model.num_classes=4")
BLOBS = ("data=dataset", "+data.dataset._target_=users_models.NoisyBlobs", *SIZES)


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["+callbacks.mine._target_=nope.Nope"],
            "callbacks.mine._target_='nope.Nope' cannot be imported (no module named nope: is it installed, or on "
            "PYTHONPATH?): check the name",
        ),
        (
            ["model._target_=mine.TwoLayerNett"],
            "model._target_='mine.TwoLayerNett' cannot be imported (mine has no TwoLayerNett (did you mean "
            "mine.TwoLayerNet?)): check the name",
        ),
        (
            ["model._target_=mine.broken.Net"],
            "model._target_='mine.broken.Net' cannot be imported (importing mine.broken failed: ZeroDivisionError: "
            "division by zero): check the name",
        ),
        (
            ["data=dataset", "+data.dataset._target_=users_models.NoisyBlobz", *SIZES],
            "data.dataset._target_='users_models.NoisyBlobz' cannot be imported (users_models has no NoisyBlobz (did "
            "you mean users_models.NoisyBlobs?)): check the name",
        ),
        (["model._target_=mine"], "model._target_='mine' is not a class: name the class to build"),
    ],
)
def test_a_target_that_cannot_be_imported_is_one_line_with_its_cause_before_the_run_directory(
    tmp_path, monkeypatch, capsys, caplog, overrides, line
):
    """Any ``_target_`` of the data (its data set too), the model, a callback or a logger is imported by the
    config check (``StartChecks``, before Hydra makes anything): the line names the key, the target and why
    (no module, a module that fails to import, a name its module lacks with the nearest), and nothing else is
    said (no ``[HYDRA]`` log lines)."""
    (tmp_path / "mods" / "mine").mkdir(parents=True)
    (tmp_path / "mods" / "mine" / "__init__.py").write_text(
        "import torch\n\n\nclass TwoLayerNet(torch.nn.Module):\n    pass\n"
    )
    (tmp_path / "mods" / "mine" / "broken.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    cfg = compose_cfg("accelerator=cpu", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    try:
        with pytest.raises(SystemExit) as stop:
            StartChecks().on_run_start(cfg)
    finally:  # this test's mine is not another test's (a user's module of that name, in the same process)
        for name in [m for m in sys.modules if m == "mine" or m.startswith("mine.")]:
            del sys.modules[name]
    assert stop.value.code == 2 and capsys.readouterr().err.splitlines() == [f"error: {line}"]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hydra")] == []  # no [HYDRA] lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mods"]


@pytest.mark.parametrize(
    "key,overrides,line",
    [
        (
            "callbacks.model_checkpoint",
            ["callbacks.model_checkpoint.mode=bad"],
            "callbacks.model_checkpoint.mode='bad' is refused by lightning.pytorch.callbacks.ModelCheckpoint "
            "(MisconfigurationException: `mode` can be min, max but got bad): give a value it takes",
        ),
        (
            "data",
            [*BLOBS, "+data.dataset.num_sample=60"],
            "data.dataset.num_sample=60: users_models.NoisyBlobs takes no num_sample (did you mean "
            "data.dataset.num_samples?): drop it with ~data.dataset.num_sample, or give an argument it takes",
        ),
        (
            "data",
            [*BLOBS, "+data.dataset.num_samples=-3"],
            "data.dataset (users_models.NoisyBlobs) cannot be built (RuntimeError: Trying to create tensor with "
            "negative dimension -3: [-3]): give it arguments its class takes",
        ),
        (
            "callbacks.mine",  # where the config check did not run first (a class built by a user's own code)
            ["+callbacks.mine._target_=nope.Nope"],
            "callbacks.mine._target_='nope.Nope' cannot be imported (no module named nope: is it installed, or on "
            "PYTHONPATH?): check the name",
        ),
        (
            "logger",
            ["logger=csv", "+logger.nope=1"],
            "logger.nope=1: lightning.pytorch.loggers.CSVLogger takes no nope (its arguments: save_dir, name, "
            "version, prefix, flush_logs_every_n_steps): drop it with ~logger.nope, or give an argument it takes",
        ),
    ],
)
def test_a_config_node_its_class_refuses_to_build_is_one_line_naming_the_key(key, overrides, line):
    """``dpddp.run.build.build``, how a run builds its data, model, callbacks and loggers: the class's refusal
    (Hydra's ``InstantiationException``, several lines) is one ``ConfigError`` naming the key of the node that
    failed (a data set inside the data), its ``_target_`` as given and the cause; the setting where the cause
    names one of the node's keys, the nearest argument for one the class does not take."""
    cfg = compose_cfg("accelerator=cpu", *overrides)
    with pytest.raises(ConfigError) as err:
        build(OmegaConf.select(cfg, key), key, _convert_="all")
    assert str(err.value) == line


def test_a_callback_its_class_refuses_ends_the_run_in_one_line_before_training(tmp_path):
    """In the run (after ``.hydra/`` and ``train.log``, before any step): the callback's line, not the Trainer
    flag check's, and no checkpoint."""
    cfg = compose_cfg("accelerator=cpu", "callbacks.model_checkpoint.save_top_k=-5", "logger=none")
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    assert str(err.value) == (
        "callbacks.model_checkpoint.save_top_k=-5 is refused by lightning.pytorch.callbacks.ModelCheckpoint "
        "(MisconfigurationException: Invalid value for save_top_k=-5. Must be >= -1): give a value it takes"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


TORCHRUN_RANK_1 = {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
TORCHRUN_RANK_1 |= {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_under_a_cluster_launcher_a_bad_setting_is_said_by_local_rank_0_only(tmp_path, monkeypatch, capsys):
    """torchrun or SLURM start every process of a node with the same command line: each refuses it with exit 2,
    and only local rank 0 says the line (a node's other processes log it quietly), so a node says it once."""
    cfg = compose_cfg("accelerator=cpu", "strategy=ddp", "devices=2", "model.lr=-1", f"hydra.run.dir={tmp_path}/run")
    for name, value in TORCHRUN_RANK_1.items():  # local rank 1 of 2 on one node, as torchrun starts it
        monkeypatch.setenv(name, value)
    own_log = logging.FileHandler(tmp_path / "rank1.log")  # a rank's log file at INFO: where the line goes
    logging.getLogger("dpddp.errors").addHandler(own_log)
    monkeypatch.setattr(logging.getLogger("dpddp.errors"), "level", logging.INFO)
    try:
        with pytest.raises(SystemExit) as stop:
            StartChecks().on_run_start(cfg)
    finally:
        logging.getLogger("dpddp.errors").removeHandler(own_log)
        own_log.close()
    line = "error: model.lr=-1 is invalid: use a learning rate in [1e-12, 1000], e.g. model.lr=0.1"
    assert stop.value.code == 2 and capsys.readouterr().err == ""
    assert (tmp_path / "rank1.log").read_text().splitlines() == [line]
    for name in TORCHRUN_RANK_1:  # no launcher: the process is local rank 0
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as stop:
        StartChecks().on_run_start(cfg)
    assert stop.value.code == 2 and capsys.readouterr().err.splitlines() == [line]


# -- Hydra's modes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["-m", "--cfg", "job", "seed=0,1"],
            "--multirun (-m) and --cfg (-c) cannot be given together: Hydra runs one of them; keep one (--cfg job "
            "prints a run's config: give one value per setting, not a sweep list)",
        ),
        (
            ["--cfg=hydra", "--info"],
            "--cfg (-c) and --info (-i) cannot be given together: Hydra runs one of them; keep one (--cfg prints the "
            "composed config; --info prints what Hydra composes it from)",
        ),
        (
            ["-r", "-m"],
            "--run (-r) and --multirun (-m) cannot be given together: Hydra runs one of them; keep one (--run runs "
            "one job; --multirun runs a sweep)",
        ),
        (["-mc", "all"], "--multirun (-m) and --cfg (-c) cannot be given together"),
        (["--resolve", "seed=1"], "--resolve works only with --cfg: add --cfg job (or hydra, all), or drop --resolve"),
    ],
)
def test_hydra_modes_that_cannot_be_combined_are_one_line(argv, line):
    assert mode_conflict(argv).startswith(line)


@pytest.mark.parametrize("argv", [[], ["-m", "seed=0,1"], ["--cfg", "job", "--resolve"], ["--info"], ["-r", "a=1"]])
def test_a_command_line_hydra_runs_as_given_is_not_refused(argv):
    assert mode_conflict(argv) is None and unreadable_override(argv) is None


LAUNCHERS = "basic, joblib, slurm, submitit_local, submitit_slurm"


@pytest.mark.parametrize(
    "argv,line",
    [
        (["hydra/launcher=nope"], f"hydra/launcher=nope is unknown: choose one of {LAUNCHERS}"),
        (["seed=1", "hydra/sweeper=foo"], "hydra/sweeper=foo is unknown: choose one of basic, dpddp_optuna"),
        (
            ["-m", "hydra/launcher=joblibb", "seed=0,1"],
            f"hydra/launcher=joblibb is unknown (did you mean joblib?): choose one of {LAUNCHERS}",
        ),
        (["+hydra/launcher=[basic,nope]"], f"hydra/launcher=nope is unknown: choose one of {LAUNCHERS}"),
        (
            ["--config-name", "nope"],
            "--config-name nope: no config nope.yaml in pkg://hydra.conf, pkg://dpddp.conf, structured://: choose one "
            "of config, or add your configs' directory with --config-dir <dir>",
        ),
        (
            ["--config-dir", "nowhere"],
            "--config-dir nowhere cannot be used (Additional config directory '{cwd}/nowhere' not found): give a "
            "directory of configs, or drop --config-dir",
        ),
        (
            ["--config-dir", "nowhere", "model=my_net"],  # the directory first: its options are unknown
            "--config-dir nowhere cannot be used (Additional config directory '{cwd}/nowhere' not found): give a "
            "directory of configs, or drop --config-dir",
        ),
        (
            ["-cp", "/nonexistent"],
            "--config-path /nonexistent cannot be used (Primary config directory not found): give a directory of "
            "configs, or drop --config-path",
        ),
        (
            ["--info", "searchpath", "hydra/launcher=nope"],
            f"hydra/launcher=nope is unknown: choose one of {LAUNCHERS}",
        ),
        (["--cfg", "jobb"], "--cfg jobb is not a choice of --cfg: give one of job, hydra, all (--cfg job)"),
        (
            ["--info", "plugin"],
            "--info plugin is not a choice of --info: give one of all, config, defaults, defaults-tree, plugins, "
            "searchpath (--info all)",
        ),
        (
            ["--info", "seed=1"],  # argparse takes an override after --info for its value
            "--info seed=1 is not a choice of --info: give one of all, config, defaults, defaults-tree, plugins, "
            "searchpath (--info all seed=1)",
        ),
        (["--nope"], "unrecognized arguments: --nope: see python train.py --help"),
        # Lightning's registered strategy names: dpddp's settings for them, before Hydra and in Hydra's failure
        (
            ["strategy=ddp_find_unused_parameters_true"],
            "strategy=ddp_find_unused_parameters_true is Lightning's name for DDPStrategy(find_unused_parameters=True, "
            "start_method='popen'): use strategy=ddp strategy.find_unused_parameters=true",
        ),
        (
            ["hydra.searchpath=[pkg://dpddp.conf]", "strategy=fsdp"],
            "strategy=fsdp (FSDPStrategy) is not offered (dpddp keeps its promises with its own strategies: auto, dp, "
            "ddp, ddp_spawn): use strategy=ddp, or strategy=dp on GPUs",
        ),
    ],
)
def test_a_config_hydra_cannot_find_or_an_option_its_parser_refuses_is_one_line_and_nothing_is_made(
    tmp_path, monkeypatch, capsys, argv, line
):
    """``train.py``'s main in this process: Hydra's many-line report of a missing config group option, primary
    config or config directory (its ``MissingConfigException`` and ``SearchPathException``, exit 1), or its
    parser's usage, is one line, exit 2, before a run or sweep directory is made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", *argv, "accelerator=cpu", "hydra.run.dir=run"])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            hydra_entry.main()
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {line.format(cwd=tmp_path)}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,typed,plugin,extra",
    [
        (["-m", "hydra/launcher=joblib", "seed=0,1"], "joblib", "hydra-joblib-launcher", "joblib"),
        (["-m", "hydra/launcher=submitit_local", "seed=0,1"], "submitit_local", "hydra-submitit-launcher", "slurm"),
        (["-m", "hydra/launcher=slurm", "seed=0,1"], "slurm", "hydra-submitit-launcher", "slurm"),
    ],
)
def test_a_packaged_launcher_whose_plugin_is_missing_is_one_line_with_its_install(
    tmp_path, monkeypatch, capsys, argv, typed, plugin, extra
):
    """The plugins' configs gone from Hydra's store (as without the extras): the line names the launcher typed
    (slurm, whose defaults list names submitit_slurm) and the install; was "hydra/launcher=... is unknown"."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the plugins imported: their configs stored
    for name in ("joblib", "submitit_local", "submitit_slurm"):
        monkeypatch.delitem(ConfigStore.instance().repo["hydra"]["launcher"], f"{name}.yaml")
    for module in ("hydra_joblib_launcher", "hydra_submitit_launcher"):
        monkeypatch.setitem(sys.modules, f"hydra_plugins.{module}", None)  # find_spec: not installed
    assert train_py_here(*argv, cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: hydra/launcher={typed} needs {plugin}, which is not installed: pip install '{plugin}>=1.2' "
        f"(or the extra: pip install -e '.[{extra}]')"
    ]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_launcher_of_an_installed_plugin_is_unknown_not_missing(tmp_path, monkeypatch, capsys):
    """The plugin is installed here: a launcher it has not is a typo (was "needs hydra-joblib-launcher ...")."""
    assert train_py_here("-m", "hydra/launcher=joblib_x", "seed=0,1", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: hydra/launcher=joblib_x is unknown (did you mean joblib?): choose one of basic, joblib, slurm, "
        "submitit_local, submitit_slurm"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_optuna_search_without_optuna_is_one_line_with_its_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # find_spec: not installed
    assert train_py_here("-m", "hparams_search=optuna", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: hparams_search=optuna needs Optuna: pip install 'optuna>=4' (or the extra: pip install -e '.[optuna]')"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override,reason",
    [
        ("model.lr=[", "no viable alternative at input '['"),
        ("model.lr=${a:${b}}", "extraneous input '}' expecting <EOF>"),
        ("seed=choice(1,2", "no viable alternative at input 'choice(1,2'"),
    ],
)
def test_an_override_hydra_cannot_read_is_one_line(override, reason):
    assert unreadable_override(["-m", "seed=0,1", override]) == (
        f"{override!r} cannot be read as an override ({reason}): write key=value, quoting a value with special "
        "characters (key='a,b'); see https://hydra.cc/docs/advanced/override_grammar/basic/"
    )


REFUSED = [
    (["devises=2"], "devises=2: the config has no key devises: did you mean devices?"),
    (["mdoel.lr=0.1"], "mdoel.lr=0.1: the config has no key mdoel.lr: did you mean model.lr?"),  # one suggestion
    (["+devises=2"], "unknown setting devises: did you mean devices?"),
    (
        ["trainer.max_epoch=2", "devises=2"],
        "trainer.max_epoch=2: the config has no key trainer.max_epoch: did you mean trainer.max_epochs?",
    ),  # the first
    (["strategy=dpp"], "strategy=dpp is unknown (did you mean dp?): choose one of auto, ddp, ddp_spawn, dp"),
    (
        ["strategy.name=fsdp", "devices=0"],
        "strategy=fsdp (FSDPStrategy) is not offered (dpddp keeps its promises with "
        "its own strategies: auto, dp, ddp, ddp_spawn): use strategy=ddp, or strategy=dp on GPUs",
    ),  # before devices
    (["devices=0"], "devices=0 is invalid: use a positive number of devices per node, or -1 for all GPUs"),
    (  # Hydra takes no null for a group (a ValueError's traceback, exit 1)
        ["logger=null"],
        "logger=null is unknown: choose one of csv, csv_tensorboard, mlflow, mlflow_wandb, none, tensorboard, wandb",
    ),
    (
        ["callbacks=[default,null]"],
        "callbacks=null is unknown: choose one of default, early_stopping, ema, lr_monitor, model_checkpoint, none, "
        "swa",
    ),
    (["accelerator=tpu"], "accelerator='tpu' is unknown: choose one of auto, cpu, gpu, cuda"),
    # a check's KeyError in Hydra's start callback was only a warning: the job ran unchecked (traceback, exit 1)
    (["~devices"], "devices is missing from the config: give it a value (--cfg job shows them)"),
    (["strategy.name=???"], "strategy.name is missing from the config: give it a value (--cfg job shows them)"),
    (["num_nodes=0"], "num_nodes=0 is invalid: use a positive number of nodes, or auto (the launcher's)"),
    (["seed=-1"], "seed=-1 is invalid: use an integer in [0, 2**32 - 1]"),
    (["data.batch_size=0"], "data.batch_size=0 is invalid: use a positive global batch size (samples per step)"),
    (["data.val_fraction=0.95"], "data.val_fraction=0.95 is invalid: use a fraction in [0, 0.9]"),
    (
        ["model.lr=${nope}"],
        "model.lr='${nope}' cannot be resolved (Interpolation key 'nope' not found): give a value, "
        "or interpolate a key that exists (e.g. ${data.num_features})",
    ),
    (
        ["hydra.run.dir=${nope}"],
        "hydra.run.dir='${nope}' cannot be resolved (Interpolation key 'nope' not found): "
        "give a directory (hydra.run.dir=runs/a)",
    ),
    (
        ["-m", "--cfg", "job", "seed=0,1"],
        "--multirun (-m) and --cfg (-c) cannot be given together: Hydra runs one of "
        "them; keep one (--cfg job prints a run's config: give one value per setting, not a sweep list)",
    ),
    (
        ["model.lr=["],
        "'model.lr=[' cannot be read as an override (no viable alternative at input '['): write "
        "key=value, quoting a value with special characters (key='a,b'); see "
        "https://hydra.cc/docs/advanced/override_grammar/basic/",
    ),
]


def test_a_group_deleted_with_null_is_left_to_hydra():
    """``~logger=null`` deletes the group whatever its option (Hydra's grammar): no option to name."""
    assert unknown_option(["~logger=null"]) is None


@pytest.mark.parametrize("args,line", REFUSED)
def test_train_py_ends_a_command_line_error_in_one_line_before_writing_anything(
    tmp_path, monkeypatch, capfd, args, line
):
    """train.py's calls in this process: the line is all that is said, exit 2, no run directory, no log."""
    code, err = train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch), capfd.readouterr().err
    assert (code, _error_lines(err)) == (2, [f"error: {line}"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_train_py_s_whole_stderr_is_the_line_for_a_key_one_sweep_job_lacks(tmp_path):
    """A train.py process, imports included: the one line, and no sweep directory, no multirun.yaml."""
    proc = run_train("-m", "data=default,digits", "data.label_noise=0.1", *ONE, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        "error: data.label_noise=0.1: the config has no key data.label_noise (the chosen data config has none; "
        "data=default has one): dpddp.data.tables.TableDataModule takes no label_noise (of the packaged config): "
        "give data a yaml of its own (conf/data/<name>.yaml)"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag,start", [("--help", "train is powered by Hydra.\n"), ("--hydra-help", "Hydra (1.3")])
def test_help_is_hydra_s_and_makes_nothing(tmp_path, monkeypatch, capfd, flag, start):
    """train.py's main in this process: Hydra's own answer (``--help``: the config groups and the config), exit 0."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", flag])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            hydra_entry.main()
    finally:
        signal.signal(signal.SIGTERM, handler)
    out = capfd.readouterr().out
    assert stop.value.code == 0 and out.startswith(start) and list(tmp_path.iterdir()) == []
    if flag == "--help":
        assert "\n== Configuration groups ==\n" in out and "\nstrategy: auto, ddp, ddp_spawn, dp\n" in out
        assert "\n== Config ==\n" in out and "\nseed: 0\n" in out


@pytest.mark.slow
def test_a_sweep_records_a_job_whose_interpolation_fails_and_goes_on(tmp_path, monkeypatch, capfd):
    """train.py's calls in this process."""
    code = train_py_here(
        "-m", "model.lr=0.05,${nope}", *ONE, "hydra.sweep.dir=sweep", cwd=tmp_path, monkeypatch=monkeypatch
    )
    err = capfd.readouterr().err
    assert code == 1, err[-2000:]  # a failed job: the sweep's usual status
    sweep = tmp_path / "sweep"
    assert metrics(sweep / "0")["world_size"] == 1
    assert (sweep / "1" / "error.txt").read_text().startswith("model.lr='${nope}' cannot be resolved")
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["status"][:6] for r in rows] == ["ok", "failed"]
    assert "Traceback" not in err


@pytest.mark.slow
def test_metrics_json_keeps_the_overrides_as_typed(tmp_path, monkeypatch):
    """An interpolation in an override that resolves: ``overrides`` has it as typed, not its value (train.py's
    calls in this process)."""
    typed = "model.optimizer=${oc.env:DPDDP_TEST_OPTIMIZER}"
    monkeypatch.setenv("DPDDP_TEST_OPTIMIZER", "adam")
    assert train_py_here(typed, *ONE, "hydra.run.dir=run", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    assert metrics(tmp_path / "run")["overrides"] == [typed, *ONE, *QUIET]


# -- launcher variables ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"), [("LOCAL_RANK", "x"), ("RANK", ""), ("WORLD_SIZE", "2.0"), ("SLURM_PROCID", "a")]
)
def test_a_launcher_variable_that_is_no_integer_is_one_line(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        refuse_non_integer_variables()
    line = f"error: {name}={value!r} (environment) is not an integer: a launcher sets it to a number; unset it "
    assert (exited.value.code, capsys.readouterr().err) == (2, f"{line}(env -u {name} ...) or give it one\n")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["train.py"], ["eval.py"], ["-m", "dpddp.check"], ["-m", "dpddp.cli", "fit"]])
def test_each_command_refuses_a_launcher_variable_that_is_no_integer_before_torch(cmd):
    """torchmetrics reads ``LOCAL_RANK`` as a number on import: each command refuses it before (``-X importtime``)."""
    env, _ = child_env(LOCAL_RANK="x")
    proc = subprocess.run([sys.executable, "-X", "importtime", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: LOCAL_RANK='x' (environment)")
    assert "dpddp.cluster" in imported and not {m.split(".")[0] for m in imported} & {
        "torch",
        "lightning",
        "torchmetrics",
    }


def test_the_composed_top_level_keys_are_the_checked_ones():
    """A misspelled top-level key's advice (``did you mean devices?``) is drawn from ``TOP_LEVEL_KEYS``."""
    assert sorted(str(k) for k in compose_cfg().keys()) == sorted(TOP_LEVEL_KEYS)


# -- the file system -----------------------------------------------------------------------------------------


def _read_only(path: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run with ``path`` read-only: a read-only bind mount in a mount namespace of its own for root (whom
    file modes do not stop), else ``path``'s mode without write permission (the caller restores it)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return cmd
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("root without a mount namespace: no way to make a read-only directory here")
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", str(path), *cmd]


def _run_read_only(path: Path, args: list[str], cwd: Path, prog: list[str] | None = None):
    env, _ = child_env()
    cmd = _read_only(path, [sys.executable, *(prog or [str(ROOT / "train.py")]), *args])
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    finally:
        path.chmod(0o755)


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_run_or_sweep_directory_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capfd, mode):
    """train.py's calls in this process, the directory under a file: ``unwritable``'s failed write, the branch a
    read-only one takes with its own reason (a read-only directory, in a process: the checkpoint and CLI tests)."""
    (tmp_path / "file").write_text("")
    args = [*(["-m"] if mode == "sweep" else []), *ONE, f"hydra.{mode}.dir=file/run"]
    assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert _error_lines(capfd.readouterr().err) == [
        f"error: hydra.{mode}.dir=file/run cannot be written (Not a directory): give a directory you can write "
        f"(hydra.{mode}.dir=<directory>)"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.slow
def test_resuming_a_run_whose_checkpoints_cannot_be_written_is_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    assert train_py_here(*ONE, "hydra.run.dir=run", cwd=tmp_path, monkeypatch=monkeypatch) == 0  # in this process
    ckpts = tmp_path / "run" / "checkpoints"
    before = (ckpts / "last.ckpt").read_bytes()
    proc = _run_read_only(ckpts, [*ONE, "trainer.max_epochs=2", "resume=true", "hydra.run.dir=run"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert any(
        lines[0] == f"error: {str(ckpts)!r} cannot be written ({why}): make it writable, or continue it in another "
        f"run directory with ckpt_path={ckpts / 'last.ckpt'}"
        for why in READ_ONLY
    ), lines[0]
    assert (ckpts / "last.ckpt").read_bytes() == before and sorted(p.name for p in ckpts.iterdir()) == [
        "best.ckpt",
        "last.ckpt",
    ]


def test_the_cli_says_a_root_directory_that_cannot_be_written_in_one_line(tmp_path, monkeypatch, capfd):
    """The CLI's main in this process, its root under a file: ``unwritable``'s failed write, the branch a read-only
    directory takes with its own reason (a read-only one, in a process: the checkpoint tests)."""
    (tmp_path / "file").write_text("")
    args = ["fit", "--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.default_root_dir=file/x"]
    code, err = cli_here(*args, cwd=tmp_path, monkeypatch=monkeypatch), capfd.readouterr().err
    assert code == 2, err[-2000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0] == (
        "error: --trainer.default_root_dir='file/x': 'file/x/lightning_logs/version_0' cannot be written (Not a "
        "directory): give a directory you can write"
    )


WRITE_ON_READ_ONLY = """
import sys
from dpddp.continuity.io import AtomicCheckpointIO
from dpddp.errors import WriteFailed
try:
    AtomicCheckpointIO().save_checkpoint({"global_step": 2, "state_dict": {}}, sys.argv[1])
except WriteFailed as err:
    print(err)
"""


@pytest.mark.slow
def test_a_checkpoint_write_on_a_read_only_directory_is_write_failed_and_the_earlier_file_whole(tmp_path):
    """The write and its clean-up both meet the read-only directory: the write's error is the one reported."""
    (tmp_path / "ckpts").mkdir()
    last = tmp_path / "ckpts" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "state_dict": {}}, last)
    before = last.read_bytes()
    proc = _run_read_only(tmp_path / "ckpts", [str(last)], tmp_path, prog=["-c", WRITE_ON_READ_ONLY])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(
        proc.stdout.strip() == f"cannot write last.ckpt in {str(last.parent)!r}: {why}: free space or make it "
        "writable, then resume (the earlier last.ckpt is whole)"
        for why in READ_ONLY
    ), proc.stdout
    assert last.read_bytes() == before and [p.name for p in last.parent.iterdir()] == ["last.ckpt"]
    assert torch.load(last, weights_only=True)["global_step"] == 1


def test_a_clean_up_that_fails_does_not_hide_the_write_error(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", refused)
    monkeypatch.setattr(Path, "unlink", refused)
    with pytest.raises(WriteFailed) as err:  # no earlier file: none is said to be whole
        AtomicCheckpointIO().save_checkpoint({"global_step": 1, "state_dict": {}}, tmp_path / "last.ckpt")
    assert str(err.value).endswith("Read-only file system: free space or make it writable, then resume")


def test_a_checkpoint_callbacks_dirpath_that_cannot_be_written_is_refused_before_the_fit(tmp_path):
    """Its first save would fail after an epoch of training; nothing is made where it points."""
    parent = tmp_path / "file"
    parent.write_text("")
    cfg = compose_cfg("accelerator=cpu", f"callbacks.model_checkpoint.dirpath={parent}/ckpts")
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value).startswith(f"callbacks.model_checkpoint.dirpath='{parent}/ckpts' cannot be written (")
    assert str(err.value).endswith("): give a directory you can write, or null for <run dir>/checkpoints")
    check_config(compose_cfg("accelerator=cpu", f"callbacks.model_checkpoint.dirpath={tmp_path}/new/ckpts"))
    assert not (tmp_path / "new").exists()


def test_a_directory_is_writable_or_says_why(tmp_path):
    assert unwritable(tmp_path / "a" / "b") is None and (tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe leaves nothing
    (tmp_path / "f").write_text("")
    assert unwritable(tmp_path / "f" / "x") == "Not a directory"
    check_output_dir(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"cannot be written \(Not a directory\): make it writable$"):
        check_output_dir(tmp_path / "f")
