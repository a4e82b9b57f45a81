"""dpddp's Optuna sweeper in process, with a launcher stand-in: a job returning nan or raising is a FAIL trial and
the search goes on; trials run in batches of ``n_jobs`` numbered as their jobs; a stopped trial stays running
and the same search continues it and reaches ``n_trials``."""

import math

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from hydra_plugins.dpddp_sweeper.optuna_sweeper import job_outcome, search

optuna = pytest.importorskip("optuna")


def job(status: JobStatus, value: object) -> JobReturn:
    ret = JobReturn(status=status)
    ret.return_value = value
    return ret


class Jobs:
    """A launcher stand-in: each job returns the next of ``values`` (an exception: a failed job); records the
    launches as (first job number, overrides)."""

    def __init__(self, *values: object) -> None:
        self.values, self.launched = iter(values), []

    def launch(self, job_overrides, initial_job_idx):
        self.launched.append((initial_job_idx, [list(o) for o in job_overrides]))
        returns = []
        for _ in job_overrides:
            value = next(self.values)
            returns.append(job(JobStatus.FAILED if isinstance(value, Exception) else JobStatus.COMPLETED, value))
        return returns


def settings(tmp_path, **changed):
    return {
        "sampler": {"_target_": "optuna.samplers.RandomSampler", "seed": 0},
        "direction": "minimize",
        "storage": f"sqlite:///{tmp_path / 'optuna.db'}",
        "study_name": "s",
        "n_trials": 3,
        "n_jobs": 1,
        "params": {"x": "interval(0,1)"},
        **changed,
    }


def config(tmp_path):
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {"direction": "minimize"}}})


def test_nan_and_raised_jobs_come_back_failed_and_finite_ones_complete():
    assert job_outcome(job(JobStatus.COMPLETED, 0.5)) == 0.5
    assert job_outcome(job(JobStatus.COMPLETED, math.nan)) is None
    assert job_outcome(job(JobStatus.COMPLETED, "a")) is None
    assert job_outcome(job(JobStatus.FAILED, RuntimeError("boom"))) is None


def test_failed_trials_are_fail_and_the_search_goes_on_in_batches_to_the_best(tmp_path):
    jobs = Jobs(0.5, math.nan, RuntimeError("boom"), 0.25, 0.75)
    search(jobs, config(tmp_path), ["a=1"], settings(tmp_path, n_trials=5, n_jobs=2))  # type: ignore[arg-type]
    assert [first for first, _ in jobs.launched] == [0, 2, 4]  # job number = trial number
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    overrides = [o for _, batch in jobs.launched for o in batch]
    assert overrides[3] == [f"x={study.trials[3].params['x']}", "a=1"]
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert (results.best_trial, results.best_value, results.best_params) == (3, 0.25, study.trials[3].params)


def test_a_trial_left_running_is_run_again_under_its_number_and_the_study_reaches_n_trials(tmp_path):
    study = optuna.create_study(storage=settings(tmp_path)["storage"], study_name="s")
    study.tell(study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), 0.5)
    running = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})  # the process was stopped here
    jobs = Jobs(0.3, 0.1, 0.2)
    search(jobs, config(tmp_path), [], settings(tmp_path, n_trials=4))  # type: ignore[arg-type]
    assert jobs.launched[0] == (1, [[f"x={running.params['x']}"]])
    assert [first for first, _ in jobs.launched] == [1, 2, 3]
    assert [t.value for t in study.trials] == [0.5, 0.3, 0.1, 0.2]


@pytest.mark.parametrize(
    ("changed", "line"),
    [
        ({"direction": ["minimize", "maximize"]}, "hydra.sweeper.direction=['minimize', 'maximize']: the search "),
        ({"n_trials": 0}, "hydra.sweeper.n_trials=0: give a positive number of trials"),
        ({"storage": None}, "hydra.sweeper.storage=null: a search without a storage cannot continue after a stop"),
    ],
)
def test_a_setting_the_search_cannot_run_is_one_line(tmp_path, changed, line):
    from dpddp.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        search(Jobs(), config(tmp_path), [], settings(tmp_path, **changed))  # type: ignore[arg-type]
    assert str(err.value).startswith(line)


def test_the_plugin_sweeper_is_registered_under_hydra_plugins():
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    names = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)]
    assert "hydra_plugins.dpddp_sweeper.optuna_sweeper.OptunaSweeper" in names
