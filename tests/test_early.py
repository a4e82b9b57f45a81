"""An answer before Lightning: ``train.py``'s ``--help``, a misspelled top-level key and a bad plain value end
before torch or Lightning is imported (read from ``python -X importtime``, not timed), with the line and exit
status the full check gives; everything else is left to the full check."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, child_env, compose_cfg

from dpddp._compat import registered_strategies
from dpddp.entry.early import answer
from dpddp.errors import ConfigError
from dpddp.parallel.settings import LIGHTNING_STRATEGIES
from dpddp.run.config import check_config
from dpddp.run.keys import TOP_LEVEL_KEYS

REFUSED = {
    "devises=2": "devises=2: the config has no key devises: did you mean devices?",
    "mdoel.lr=0.1": "mdoel.lr=0.1: the config has no key mdoel.lr: did you mean model.lr?",  # one suggestion
    "devices=0": "devices=0 is invalid: use a positive number of devices per node, or -1 for all GPUs",
    "strategy=dpp": "strategy=dpp is unknown (did you mean dp?): choose one of auto, ddp, ddp_spawn, dp",
    "data.val_fraction=0.95": "data.val_fraction=0.95 is invalid: use a fraction in [0, 0.9]",
}
PLAIN = ("devices=0", "data.val_fraction=0.95", "accelerator=tpu", "num_nodes=0", "seed=-1", "data.batch_size=0")


def _imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports as imported."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in ("torch", "lightning", "torchmetrics"))


def _train(*args: str) -> subprocess.CompletedProcess:
    env, _ = child_env()
    cmd = [sys.executable, "-X", "importtime", str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("override", sorted(REFUSED))
def test_a_bad_setting_is_one_line_and_exit_2_before_torch_and_lightning(override):
    proc = _train(override)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert (proc.returncode, errors) == (2, [f"error: {REFUSED[override]}"])
    imported = _imported(proc.stderr)
    assert "dpddp.entry.early" in imported and "hydra" in imported
    assert _heavy(imported) == [] and "dpddp.entry.hydra" not in imported


HYDRA_HELP = (
    "import sys, hydra; from dpddp.cluster import register_resolvers; register_resolvers(); sys.argv[0] = 'train.py'; "
    "hydra.main(version_base='1.3', config_path='pkg://dpddp.conf', config_name='config')(print)()"
)
"""Hydra's own ``--help`` of the packaged config (``hydra.main``'s)."""


@pytest.mark.slow
def test_help_is_hydra_s_text_before_torch_and_lightning():
    proc = _train("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("train is powered by Hydra.")
    assert "== Configuration groups ==" in proc.stdout and "strategy: auto, ddp, ddp_spawn, dp" in proc.stdout
    assert _heavy(_imported(proc.stderr)) == []
    env, _ = child_env()
    hydra = subprocess.run([sys.executable, "-c", HYDRA_HELP, "--help"], env=env, capture_output=True, text=True)
    assert (hydra.returncode, hydra.stdout) == (0, proc.stdout)


@pytest.mark.parametrize("override", PLAIN)
def test_the_early_line_is_the_full_check_s(override, capsys):
    with pytest.raises(ConfigError) as full:
        check_config(compose_cfg(override))
    with pytest.raises(SystemExit) as end:
        answer([override])
    assert end.value.code == 2
    assert capsys.readouterr().err == f"error: {full.value}\n"


SWEEP = "a sweep: each job's own check"


@pytest.mark.parametrize(
    "argv,full",
    [
        ([], None),
        (["devices=1", "trainer.max_epochs=2"], None),  # nothing wrong
        (["trainer.max_epoch=2"], "Could not override 'trainer.max_epoch'"),  # a key under a group: Hydra's refusal
        (["strategy=fsdp"], "In 'config': Could not find 'strategy/fsdp'"),  # Lightning's name: Lightning describes it
        (["strategy.name=fsdp", "devices=0"], "strategy=fsdp (FSDPStrategy) is not offered"),  # ... before devices
        (["trainer.max_epoch=2", "devises=2"], "Could not override 'trainer.max_epoch'"),  # Hydra's, the first
        (["-m", "devices=0,1"], SWEEP),  # an option, a sweep
        (["devices=0,1"], SWEEP),
        (["+devises=2"], "unknown setting devises: did you mean devices?"),  # an addition the full check refuses
    ],
)
def test_what_needs_the_full_check_is_left_to_it(capsys, argv, full):
    """The early answer returns without a line of its own, and the full check (Hydra's composition, then
    ``check_config``) gives the line: ``full``'s start, or nothing for a config that runs."""
    assert answer(argv) is None
    assert capsys.readouterr() == ("", "")
    if full == SWEEP:
        return
    try:
        check_config(compose_cfg(*argv))
        said = None
    except Exception as err:
        said = str(err)
    assert said == full if full is None else said is not None and said.startswith(full), said


def test_lightning_s_strategy_names_are_all_known_before_it_is_imported():
    assert set(registered_strategies()) <= LIGHTNING_STRATEGIES


def test_the_composed_top_level_keys_are_the_checked_ones():
    """The early line's advice (``did you mean devices?``) is drawn from the composed config's top-level keys,
    the full check's from ``TOP_LEVEL_KEYS``: the same."""
    assert sorted(str(k) for k in compose_cfg().keys()) == sorted(TOP_LEVEL_KEYS)


@pytest.mark.parametrize(
    ("name", "value"), [("LOCAL_RANK", "x"), ("RANK", ""), ("WORLD_SIZE", "2.0"), ("SLURM_PROCID", "a")]
)
def test_a_launcher_variable_that_is_no_integer_is_one_line_before_torch(monkeypatch, capsys, name, value):
    """torchmetrics reads ``LOCAL_RANK`` as a number on import: the early answer refuses it first, any arguments."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        answer(["seed=1"])
    line = f"error: {name}={value!r} (environment) is not an integer: a launcher sets it to a number; unset it "
    assert (exited.value.code, capsys.readouterr().err) == (2, f"{line}(env -u {name} ...) or give it one\n")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["train.py"], ["eval.py"], ["-m", "dpddp.check"], ["-m", "dpddp.cli", "fit"]])
def test_each_command_refuses_a_launcher_variable_that_is_no_integer_before_torch(cmd):
    env, _ = child_env(LOCAL_RANK="x")
    proc = subprocess.run([sys.executable, "-X", "importtime", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: LOCAL_RANK='x' (environment)")
    assert _heavy(_imported(proc.stderr)) == []


@pytest.mark.parametrize(
    "argv,line",
    [
        (["hydra/launcher=joblibb"], "hydra/launcher=joblibb is unknown: choose one of basic, joblib, slurm, "),
        (["seed=1", "hydra/sweeper=foo"], "hydra/sweeper=foo is unknown: choose one of basic, dpddp_optuna"),
        (["+hydra/launcher=[basic,nope]"], "hydra/launcher=nope is unknown: choose one of basic, joblib, slurm, "),
    ],
)
def test_an_unknown_option_of_hydra_s_group_is_hydra_s_line_without_m(capsys, argv, line):
    """The line ``-m`` gets from Hydra's failure (test_command_line_errors), not "the config has no key"."""
    with pytest.raises(SystemExit) as exited:
        answer(argv)
    full = line + "submitit_local, submitit_slurm" if line.endswith(", ") else line
    assert (exited.value.code, capsys.readouterr().err) == (2, f"error: {full}\n")
