"""dpddp's Optuna sweeper (``hparams_search=optuna``) on the current Optuna: the search space it reads, a NaN trial
recorded as FAIL with the search going on, and a search stopped by SIGTERM continued with its printed command."""

import os
import shlex
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import CONF, ROOT, metrics, run_train
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from dpddp.entry.command_line import sweep_refusal
from dpddp.entry.hydra import CONFIG_DIR
from dpddp.errors import ConfigError, invocations
from hydra_plugins.dpddp_sweeper.optuna_sweeper import search_space, trial_overrides

optuna = pytest.importorskip("optuna")


def test_the_search_space_of_the_packaged_params_and_the_command_line():
    params = {"model.lr": "tag(log, interval(0.001, 1.0))", "data.batch_size": "choice(32, 64, 128, 256)"}
    args = ["seed=range(0,3)", "data.batch_size=64", "trainer.max_epochs=int(interval(1,3))", "+x=choice(a,true)"]
    space, fixed = search_space(params, args)
    assert space == {
        "model.lr": FloatDistribution(0.001, 1.0, log=True),
        "seed": CategoricalDistribution([0, 1, 2]),  # Hydra's range: its stop excluded
        "trainer.max_epochs": IntDistribution(1, 3),
        "+x": CategoricalDistribution(["a", True]),
    }
    assert fixed == ["data.batch_size=64"]  # a fixed value replaces the packaged choice
    params_of_a_trial = {"model.lr": 0.01, "seed": 2, "trainer.max_epochs": 3, "+x": True}
    assert trial_overrides(7, params_of_a_trial, (space, fixed)) == [
        "model.lr=0.01", "seed=2", "trainer.max_epochs=3", "+x=True", "data.batch_size=64"
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^trial 7 of the study samples model.lr, the search space model.lr, seed"):
        trial_overrides(7, {"model.lr": 0.01}, (space, fixed))


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("model.lr=tag(log,interval(0.01,0.1))", None),
        ("model.lr=tag(x,interval(0.01,0.1))", "model.lr=tag(x,interval(0.01,0.1)): the Optuna sweeper knows the "),
        ("hydra.sweeper.storage=null", "hydra.sweeper.storage=null: a search without a storage cannot continue"),
        ("hydra.sweeper.n_jobs=0", "hydra.sweeper.n_jobs=0: give a positive number of trials"),
    ],
)
def test_a_search_its_sweeper_cannot_run_is_one_line_before_the_sweep_starts(override, line):
    """``sweep_refusal`` (StartChecks, before the sweep's directory is made) answers for the Optuna search."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        config = loader.load_configuration("config", ["hparams_search=optuna", override], RunMode.MULTIRUN)
        said = sweep_refusal(config)
    assert said == line if line is None else said.startswith(line)


class SigtermOnce(pl.Callback):
    """Test helper (``+callbacks.stop._target_=test_optuna.SigtermOnce``, with ``tests/`` on ``PYTHONPATH``): before
    the first batch of the first job that starts once the file ``after`` exists, SIGTERMs its own process (the
    sweep's, under the basic launcher)."""

    def __init__(self, after: str) -> None:
        self.after, self.sent = Path(after), Path(after + ".sigterm")

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == 0 and self.after.exists() and not self.sent.exists():
            self.sent.touch()
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_stopped_search_continues_with_its_printed_command_to_n_trials_with_nan_trials_failed(tmp_path):
    """6 trials; a trial without validation returns nan: FAIL, and the search goes on. A SIGTERM in the third trial
    stops the search (exit 143, one line); the printed command keeps trials 0 and 1, continues trial 2 from its
    ``last.ckpt`` in its own directory, and samples trials 3 to 5: 6 trials, none run twice."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    args = ["hparams_search=optuna", "hydra.sweeper.n_trials=6", "hydra.sweeper.sampler.seed=0", "accelerator=cpu"]
    args += ["data.num_samples=606", "data.batch_size=64", "trainer.max_epochs=2", "logger=none"]
    args += ["trainer.limit_val_batches=choice(1.0,0)", "+callbacks.stop._target_=test_optuna.SigtermOnce"]
    args += ["+callbacks.stop.after=opt/1/metrics.json", "hydra.sweep.dir=opt"]
    proc = run_train(*args, cwd=tmp_path, env=env)
    assert proc.returncode == 143, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert (
        len(lines) == 1 and "stopped by SIGTERM (1 of 3 jobs finished; stopped with a checkpoint: job 2; " in lines[0]
    )
    sweep = tmp_path / "opt"
    storage = f"sqlite:///{sweep / 'optuna.db'}"
    states = [t.state.name for t in optuna.load_study(study_name="dpddp", storage=storage).trials]
    assert states == ["COMPLETE", "FAIL", "RUNNING"]  # seed 0: trial 1 has no validation; trial 2 was stopped
    stopped_at = _step(sweep / "2/checkpoints/last.ckpt")
    stamps = [(sweep / j / "metrics.json").stat().st_mtime_ns for j in "01"]

    command = shlex.split(lines[0].split("resume with ", 1)[1])
    assert command[:2] == ["python", str(ROOT / "train.py")] and f"hydra.sweep.dir={sweep}" in command
    again = run_train(*command[2:], cwd=tmp_path, env=env)
    assert again.returncode == 1, again.stderr[-3000:]  # nan trials failed
    trials = optuna.load_study(study_name="dpddp", storage=storage).trials
    assert [t.number for t in trials] == list(range(6))
    for t in trials:  # a trial without validation is FAIL, one with it COMPLETE with its job's val/loss
        job = sweep / str(t.number)
        if t.params["trainer.limit_val_batches"] == 0:
            assert t.state.name == "FAIL" and (job / "error.txt").read_text().startswith(
                "val/loss (the objective) is nan"
            )
        else:
            assert t.state.name == "COMPLETE" and t.value == metrics(job)["val/loss"]
        assert len(invocations(job, CONFIG_DIR)) == (2 if t.number == 2 else 1)  # none run twice; trial 2 continued
    assert "COMPLETE" in [t.state.name for t in trials[2:]]  # the search went on after the FAIL
    assert [(sweep / j / "metrics.json").stat().st_mtime_ns for j in "01"] == stamps
    assert "resuming interrupted job from" in (sweep / "2/train.log").read_text()
    assert 1 <= stopped_at < _step(sweep / "2/checkpoints/last.ckpt") == _step(sweep / "0/checkpoints/last.ckpt")
    best = min((t for t in trials if t.value is not None), key=lambda t: t.value)
    results = (sweep / "optimization_results.yaml").read_text()
    assert f"best_trial: {best.number}\n" in results and f"best_value: {best.value}\n" in results
    assert "| best |" in (sweep / "summary.md").read_text().splitlines()[best.number + 4]


def _step(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
