"""The Optuna sweeper's launcher wrapper: a job returning nan or raising comes back failed, so
one failed job does not end the search."""

import math

import pytest
from hydra.core.utils import JobReturn, JobStatus

from dpddp.entry.sweeper import FailedTrial, NanFailsLauncher


class Returns:
    """A launcher stand-in returning the given jobs."""

    def __init__(self, *returns: JobReturn) -> None:
        self.returns = returns

    def launch(self, job_overrides, initial_job_idx):
        return list(self.returns)


def job(status: JobStatus, value: object) -> JobReturn:
    ret = JobReturn(status=status)
    ret.return_value = value
    return ret


def test_nan_and_raised_jobs_come_back_failed_and_finite_ones_complete():
    raised = RuntimeError("boom")
    wrapper = NanFailsLauncher(Returns())  # type: ignore[arg-type]
    wrapper.launcher = Returns(
        job(JobStatus.COMPLETED, 0.5), job(JobStatus.COMPLETED, math.nan), job(JobStatus.FAILED, raised)
    )
    ok, nan, failed = wrapper.launch([["a=1"], ["a=2"], ["a=3"]], initial_job_idx=4)
    assert ok.return_value == 0.5 and wrapper.completed == 1
    with pytest.raises(FailedTrial, match=r"job 5 returned nan \(see its error.txt\)"):
        _ = nan.return_value
    with pytest.raises(RuntimeError, match="boom"):
        _ = failed.return_value


def test_the_plugin_sweeper_is_registered_under_hydra_plugins():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    names = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)]
    assert "hydra_plugins.dpddp_sweeper.optuna_sweeper.RecordingOptunaSweeper" in names
