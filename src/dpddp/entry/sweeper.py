"""What the Optuna sweeper of ``hparams_search=optuna`` (``hydra_plugins.dpddp_sweeper``) adds to
hydra-optuna-sweeper's: a job returning ``nan`` is recorded as ``TrialState.FAIL`` instead of ending the search
(``conf/hydra/sweeper/dpddp_optuna.yaml``); a search stopped by SIGTERM launches no further trials."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from typing_extensions import override

from dpddp.continuity import stop as sweep_stop
from dpddp.entry.summary import end_sweep, objective_of

__all__ = ["FailedTrial", "NanFailsLauncher"]


class FailedTrial(RuntimeError):
    """The return value of a job whose result is ``nan``: it failed (its ``error.txt`` says why)."""


def _failed(ret: JobReturn) -> bool:
    """Whether a finished job failed: it raised, or returned something that is not a finite number."""
    if ret.status != JobStatus.COMPLETED:
        return True
    try:
        return not math.isfinite(float(ret.return_value))
    except (TypeError, ValueError):
        return True


class NanFailsLauncher(Launcher):
    """Wraps the sweeper's launcher: a job that returns ``nan`` comes back with status ``FAILED``, so the
    Optuna sweeper records a failed trial; counts the jobs that did not fail. Once the sweep is stopped by
    SIGTERM, ends it (``end_sweep``: summary, resume line, exit 143) instead of returning to the sweeper."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.completed = 0
        self.sweep_dir: Path | None = None
        self.objective = ("val/loss", False)

    @override
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.launcher.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.objective = objective_of(config)

    @override
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        returns = list(self.launcher.launch(job_overrides, initial_job_idx))
        for num, ret in enumerate(returns, start=initial_job_idx):
            if not _failed(ret):
                self.completed += 1
            elif ret.status == JobStatus.COMPLETED:
                ret.return_value = FailedTrial(f"job {num} returned {ret.return_value!r} (see its error.txt)")
                ret.status = JobStatus.FAILED
        if sweep_stop.active() and sweep_stop.requested() and self.sweep_dir is not None:
            end_sweep(self.sweep_dir, cut_short=True, objective=self.objective)
        return returns
