"""Every sweep syntax of Hydra 1.3's grammar (a list, choice, range, interval, glob, tag, sort, shuffle) runs under
the sweeper chosen, or is one line naming what takes it, before the sweep starts (case 52)."""

import copy
import functools

import pytest
from conftest import CONF, train_py_here
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write

from dpddp.entry.command_line import repeated_key, sweep_refusal, sweep_without_multirun

OPTUNA = "hparams_search=optuna"
# (override, the basic sweeper's jobs, or the one line), each under the basic sweeper and Optuna's
BASIC = [
    ("seed=0,1", ["seed=0", "seed=1"]),
    ("seed=choice(0,1)", ["seed=0", "seed=1"]),
    ("seed=range(1,3)", ["seed=1", "seed=2"]),
    ("model.lr=range(0.1,0.3,0.1)", ["model.lr=0.1", "model.lr=0.2"]),
    ("seed=sort(3,1,2)", ["seed=1", "seed=2", "seed=3"]),
    ("seed=shuffle(range(3))", {"seed=0", "seed=1", "seed=2"}),  # in an order of its own
    ("model.lr=tag(small,choice(0.1,0.2))", ["model.lr=0.1", "model.lr=0.2"]),
    ("model=glob(*,exclude=transformer)", ["model=default", "model=mlp"]),
    ("logger=glob(*,exclude=[*_*,m*,w*,t*,c*])", ["logger=none"]),
    (
        "model.lr=interval(0.01,0.1)",
        "model.lr=interval(0.01,0.1): interval() needs a sampling sweeper (hparams_search=optuna), or give a list "
        "(model.lr=0.01,0.1)",
    ),
    (
        "model.lr=tag(log,interval(0.01,0.1))",
        "model.lr=tag(log,interval(0.01,0.1)): interval() needs a sampling sweeper (hparams_search=optuna), or give "
        "a list (model.lr=0.01,0.1)",
    ),
    (
        "model.lr=glob(*)",
        "model.lr=glob(*): glob() picks options of a config group, and model.lr is not one: give a list (model.lr=a,b)",
    ),
    (
        "model=glob(x*)",
        "model=glob(x*) matches none of the options of model (default, mlp, transformer): give a pattern that "
        "matches one",
    ),
    ("seed=range(3,1)", "seed=range(3,1) has no values: give a range whose start is below its stop, e.g. range(1,4)"),
    ("seed=range(1,2)", ["seed=1"]),  # one value from whole numbers: meant
    (
        "model.lr=range(0.1,0.3)",
        "model.lr=range(0.1,0.3) gives one value (0.1): range() steps by 1 unless given a step: give one, e.g. "
        "model.lr=range(0.1,0.3,0.05), or list the values",
    ),  # Hydra's step is 1: a float range without one would run one job
]
# Optuna's sweeper samples intervals and takes lists, ranges and choices; a glob is the basic sweeper's.
SAMPLED = {
    "model.lr=interval(0.01,0.1)": None,
    "model.lr=tag(log,interval(0.01,0.1))": None,
    "model=glob(*,exclude=transformer)": "model=glob(*,exclude=transformer): glob() is the basic sweeper's; a "
    "sampling sweeper takes the options as model=choice(default,mlp)",
    "logger=glob(*,exclude=[*_*,m*,w*,t*,c*])": "logger=glob(*,exclude=[*_*,m*,w*,t*,c*]): glob() is the basic "
    "sweeper's; a sampling sweeper takes the options as logger=choice(none)",
}


@functools.cache
def _composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return GlobalHydra.instance().config_loader().load_configuration("config", list(overrides), RunMode.MULTIRUN)


def _sweep(override: str, *base: str) -> tuple[str | None, list[list[str]] | None]:
    """``sweep_refusal`` of the sweep ``base`` with the command-line ``override`` (the config of ``base`` composed
    once: the check reads the sweeper, its params and the overrides), and (none) the basic sweeper's jobs."""
    cfg = copy.deepcopy(_composed(*base))
    with open_dict(cfg), read_write(cfg):
        cfg.hydra.overrides.task = [*base, override]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # its config loader: a glob's options
        line = sweep_refusal(cfg)
        if line is not None or base:
            return line, None
        parsed = OverridesParser.create(GlobalHydra.instance().config_loader()).parse_overrides([override])
        (jobs,) = BasicSweeper.split_arguments(parsed, None)
        return None, jobs


@pytest.mark.parametrize("override,expected", BASIC, ids=[o for o, _ in BASIC])
@pytest.mark.parametrize("sweeper", ["basic", "optuna"])
def test_each_sweep_syntax_runs_under_its_sweeper_or_is_one_line(override, expected, sweeper):
    if sweeper == "basic":
        line, jobs = _sweep(override)
        if isinstance(expected, set):
            assert line is None and jobs is not None and {job for (job,) in jobs} == expected and len(jobs) == 3
        else:
            assert (line, jobs) == ((expected, None) if isinstance(expected, str) else (None, [[j] for j in expected]))
        return
    line, _ = _sweep(override, OPTUNA)
    refused = SAMPLED.get(override, expected if isinstance(expected, str) else None)
    assert line == refused


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "seed=0,1",
            "seed=0,1 is a sweep: add -m to run a job for each value, or give one value (seed=[0,1] is a "
            "list, seed='0,1' a string)",
        ),  # fmt: skip
        (
            "model.lr=interval(0.01,0.1)",
            "model.lr=interval(0.01,0.1) is a sweep: add -m hparams_search=optuna to sample it, or give one value",
        ),  # fmt: skip
        ("model=glob(*)", "model=glob(*) is a sweep: add -m to run a job for each value, or give one value"),
    ],
)
def test_a_sweep_in_a_single_run_is_one_line(override, line):
    assert sweep_without_multirun(["accelerator=cpu", override]) == line
    assert sweep_without_multirun(["-m", override]) is None
    assert sweep_without_multirun([OPTUNA, override]) is None  # its config may sweep: Hydra decides


def test_case_52_interval_under_the_basic_sweeper_is_one_line_and_nothing_is_made(tmp_path, monkeypatch, capsys):
    """``python train.py -m 'model.lr=interval(0.01,0.1)'``, train.py's main in this process."""
    code = train_py_here(
        "-m", "model.lr=interval(0.01,0.1)", "hydra.sweep.dir=sweep", cwd=tmp_path, monkeypatch=monkeypatch
    )
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {BASIC[9][1]}"]
    assert list(tmp_path.iterdir()) == []


def test_a_key_given_twice_on_a_sweeps_command_line_is_warned():
    """Hydra sweeps the last of them alone, silently (``model.lr=0.1,0.2 model.lr=0.3``: one job)."""
    cfg = copy.deepcopy(_composed())
    with open_dict(cfg), read_write(cfg):
        cfg.hydra.overrides.task = ["model.lr=0.1,0.2", "seed=1", "model.lr=0.3"]
    assert (
        repeated_key(cfg)
        == "warning: model.lr is given twice (model.lr=0.1,0.2, then model.lr=0.3): the sweep takes the last"
    )
    with open_dict(cfg), read_write(cfg):
        cfg.hydra.overrides.task = ["model.lr=0.1,0.2", "seed=1"]
    assert repeated_key(cfg) is None
