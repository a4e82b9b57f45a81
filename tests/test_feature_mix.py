"""A mix of Lightning's callbacks, Trainer modes, checkpoint kinds and strategy names, and of Hydra's sweep syntaxes
under the basic sweeper and Optuna's, each through ``train.py`` (issue 38): it works (exit 0, and the objective a
finite number in each job's ``metrics.json``), or it is one line on stderr, exit 2, naming the setting and a fix,
with nothing written. One process rows run ``train.py``'s own two calls (``answer``, then ``main``) in this process;
the ddp(2) row runs ``train.py`` as a subprocess."""

import json
import math
from pathlib import Path

import pytest
from conftest import QUIET, compose_cfg, run_train, train_py_here

from dpddp.parallel.rules import STRATEGIES
from dpddp.run.training import train

TINY = ["accelerator=cpu", "data.num_samples=200", "trainer.max_epochs=1", *QUIET]
CB = "+callbacks.cb._target_=lightning.pytorch.callbacks."
OPTUNA = "hparams_search=optuna"
PLAIN_DATA = ["~data", "+data._target_=users_models.PlainData", "model=mlp", "model.num_features=4"]
PLAIN_DATA += ["model.num_classes=3"]


def works(jobs: int = 0):
    """A run (``jobs=0``) or a sweep of ``jobs`` jobs that ends with exit 0."""
    return ("works", jobs)


def refused(*said: str):
    """One line, exit 2, nothing written; the line holds each of ``said`` (the setting, its fix)."""
    return ("refused", said)


# (id, the overrides ({ckpt}: the checkpoints of a one-epoch run), the expectation)
ROWS = [
    # callbacks: those that need a logger, and others of Lightning's
    ("LearningRateMonitor, no logger", [f"{CB}LearningRateMonitor"], refused("callbacks.cb", "logger=csv")),
    ("LearningRateMonitor, csv", [f"{CB}LearningRateMonitor", "logger=csv"], works()),
    ("DeviceStatsMonitor, no logger", [f"{CB}DeviceStatsMonitor"], refused("callbacks.cb", "logger=csv")),
    ("EarlyStopping", [f"{CB}EarlyStopping", "+callbacks.cb.monitor=val/loss"], works()),
    ("StochasticWeightAveraging", [f"{CB}StochasticWeightAveraging", "+callbacks.cb.swa_lrs=0.01"], works()),
    ("EMAWeightAveraging", [f"{CB}EMAWeightAveraging"], works()),
    # a callback built without an argument it requires (ThroughputMonitor's batch_size_fn), and with it
    (
        "ThroughputMonitor, no batch_size_fn",
        [f"{CB}ThroughputMonitor"],
        refused("callbacks.cb: lightning.pytorch.callbacks.ThroughputMonitor needs batch_size_fn", "+callbacks.cb."),
    ),
    (
        "ThroughputMonitor, batch_size_fn",
        [
            f"{CB}ThroughputMonitor",
            "+callbacks.cb.batch_size_fn._target_=builtins.len",
            "+callbacks.cb.batch_size_fn._partial_=true",
        ],
        works(),
    ),
    # Trainer modes that switch off what the outputs rely on
    ("barebones", ["trainer.barebones=true"], refused("trainer.barebones", "trainer.enable_progress_bar=false")),
    (
        "enable_checkpointing=false",
        ["trainer.enable_checkpointing=false"],
        refused("trainer.enable_checkpointing", "callbacks.model_checkpoint=null callbacks.last_checkpoint=null"),
    ),
    (
        "enable_checkpointing=false, no checkpoint callbacks",
        ["trainer.enable_checkpointing=false", "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null"],
        works(),
    ),
    ("logger=false", ["+trainer.logger=false"], refused("trainer.logger", "logger=csv|")),
    # checkpoints that cannot continue a run, and one that can
    ("weights-only checkpoint", ["ckpt_path={ckpt}/wo.ckpt"], refused("ckpt_path=", "continue from ckpt_path=")),
    ("another model's checkpoint", ["ckpt_path={ckpt}/last.ckpt", "model=mlp"], refused("ckpt_path=", "give a")),
    ("truncated checkpoint", ["ckpt_path={ckpt}/cut.ckpt"], refused("ckpt_path=", "give a last.ckpt")),
    ("full checkpoint", ["ckpt_path={ckpt}/last.ckpt", "trainer.max_epochs=2"], works()),
    # Lightning's registered strategy names
    (
        "ddp_find_unused_parameters_true",
        ["strategy=ddp_find_unused_parameters_true"],
        refused("strategy=ddp_find_unused_parameters_true", "use strategy=ddp strategy.find_unused_parameters=true"),
    ),
    (
        "ddp_notebook",
        ["strategy=ddp_notebook"],
        refused("strategy=ddp_notebook", "use strategy=ddp strategy.launch=fork"),
    ),
    ("fsdp", ["strategy=fsdp"], refused("strategy=fsdp", "use strategy=ddp")),
    ("strategy.name=deepspeed", ["strategy.name=deepspeed"], refused("strategy=deepspeed", "use strategy=ddp")),
    pytest.param(
        "ddp(2), find_unused_parameters",
        ["strategy=ddp", "devices=2", "strategy.find_unused_parameters=true"],
        works(),
        marks=pytest.mark.slow,
        id="ddp(2), find_unused_parameters",
    ),
    # a plain LightningDataModule of the user's own (its batch size named bs): one process takes it as it is;
    # several would each get every batch
    ("a plain data module", PLAIN_DATA, works()),
    (
        "a plain data module, ddp(2)",
        [*PLAIN_DATA, "strategy=ddp", "devices=2"],
        refused("data._target_=users_models.PlainData would give each of 2 processes every batch", "data=sharded"),
    ),
    # Hydra's sweep syntaxes, under the basic sweeper and Optuna's
    ("a comma list without -m", ["seed=0,1"], refused("seed=0,1", "add -m")),
    ("range()", ["-m", "seed=range(0,2)"], works(2)),
    (
        "glob() and tag(choice())",
        ["-m", "model=glob(*,exclude=transformer)", "model.lr=tag(small,choice(0.1))"],
        works(2),
    ),
    ("interval(), basic sweeper", ["-m", "model.lr=interval(0.01,0.1)"], refused("model.lr=", OPTUNA)),
    ("glob() matching nothing", ["-m", "model=glob(x*)"], refused("model=glob(x*)", "give a pattern")),
    ("range() with no values", ["-m", "seed=range(3,1)"], refused("seed=range(3,1)", "e.g. range(1,4)")),
    (
        "glob(), Optuna",
        ["-m", OPTUNA, "model=glob(*)"],
        refused("model=glob(*)", "model=choice(default,mlp,transformer)"),
    ),
    (
        "interval(), Optuna",
        ["-m", OPTUNA, "model.lr=interval(0.01,0.1)", "hydra.sweeper.n_trials=2", "data.batch_size=32"],
        works(2),
    ),
]
IDS = [row[0] if isinstance(row, tuple) else row.id for row in ROWS]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """The checkpoints directory of a one-epoch run: last.ckpt, wo.ckpt (weights only), cut.ckpt (half a file)."""
    run = tmp_path_factory.mktemp("first")
    wo = f"{CB}ModelCheckpoint"
    train(compose_cfg(*TINY, wo, "+callbacks.cb.save_weights_only=true", "+callbacks.cb.filename=wo"), run)
    found = run / "checkpoints"
    whole = (found / "last.ckpt").read_bytes()
    (found / "cut.ckpt").write_bytes(whole[: len(whole) // 2])
    return found


def _tiny(overrides: list[str]) -> list[str]:
    """``TINY``, without its data size for a row that brings a data module of its own (``~data``)."""
    return [a for a in TINY if not (a.startswith("data.") and "~data" in overrides)]


def _objective(run_dir: Path) -> float:
    found = json.loads((run_dir / "metrics.json").read_text())
    return found[found["objective"]]


@pytest.mark.parametrize("name,overrides,expected", ROWS, ids=IDS)
def test_each_feature_works_or_is_one_line_and_nothing_is_written(
    name, overrides, expected, ckpt, tmp_path, monkeypatch, capfd
):
    argv = [o.format(ckpt=ckpt) for o in overrides] + [*_tiny(overrides), "hydra.run.dir=run", "hydra.sweep.dir=sweep"]
    before = sorted(ckpt.iterdir())
    monkeypatch.chdir(tmp_path)
    kind, detail = expected
    if "devices=2" in overrides and kind == "works":  # the strategy is the point: train.py's own processes
        done = run_train(*argv, cwd=tmp_path, check=True)
        assert done.returncode == 0 and math.isfinite(_objective(tmp_path / "run"))
        return
    code = train_py_here(*argv, cwd=tmp_path, monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    if kind == "works":
        assert code == 0, err[-3000:]
        runs = [tmp_path / "sweep" / str(job) for job in range(detail)] if detail else [tmp_path / "run"]
        assert all(math.isfinite(_objective(run)) for run in runs)
        if detail:  # no more jobs than that
            assert sorted(p.parent.name for p in (tmp_path / "sweep").glob("*/metrics.json")) == [
                str(job) for job in range(detail)
            ]
        return
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and err == f"{lines[0]}\n" and lines[0].startswith("error: "), err[-3000:]
    line = lines[0]
    assert all(part in line for part in detail), line
    assert list(tmp_path.iterdir()) == [] and sorted(ckpt.iterdir()) == before


SWEPT = [row for row in ROWS if isinstance(row, tuple) and row[2][0] == "refused" and "-m" not in row[1]]
SWEPT = [row for row in SWEPT if not any("," in o for o in row[1])]  # each job sets it as the row does


@pytest.mark.parametrize("name,overrides,expected", SWEPT, ids=[row[0] for row in SWEPT])
def test_a_refused_feature_in_a_sweep_fails_each_job_with_its_line(
    name, overrides, expected, ckpt, tmp_path, monkeypatch, capfd
):
    """The same rows in a sweep (``-m seed=0,1``): each job is checked in itself, so each fails with the row's line
    in its ``error.txt`` and the summary, no traceback, and the sweep exits 1 naming them; a strategy option none
    has is refused for the whole sweep, as for one run."""
    argv = ["-m", "seed=0,1", *(o.format(ckpt=ckpt) for o in overrides), *_tiny(overrides), "hydra.sweep.dir=sweep"]
    monkeypatch.chdir(tmp_path)
    code = train_py_here(*argv, cwd=tmp_path, monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    up_front = any(o.startswith("strategy=") and o[9:] not in STRATEGIES for o in overrides)  # no such option
    assert code == (2 if up_front else 1) and "Traceback" not in err, err[-3000:]
    if up_front:  # one line, nothing written
        assert err.count("\n") == 1 and all(part in err for part in expected[1]) and list(tmp_path.iterdir()) == []
        return
    assert err.splitlines()[-1] == "error: 2 of 2 jobs failed: jobs 0, 1"
    for job in (0, 1):
        line = (tmp_path / "sweep" / str(job) / "error.txt").read_text().strip()
        assert all(part in line for part in expected[1]), line
