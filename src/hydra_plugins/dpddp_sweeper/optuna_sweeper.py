"""``hydra/sweeper=dpddp_optuna``: the Optuna search of ``hparams_search=optuna``, on Optuna's ask-and-tell interface
(docs/sweeps.md). Hydra imports this module in every run: Optuna and dpddp's entry only when a search runs."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.types import IntervalSweep, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial, Trial

    SearchSpace = tuple[dict[str, BaseDistribution], list[str]]  # the sampled keys' distributions, the fixed overrides

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    """Takes ``hydra.sweeper``'s settings (the ``sampler`` config not instantiated); ``sweep`` runs ``search``."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.launcher: Launcher | None = None
        self.config: DictConfig | None = None

    @override
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    @override
    def sweep(self, arguments: list[str]) -> None:
        from dpddp.errors import ConfigError, fail

        assert self.launcher is not None and self.config is not None  # setup ran
        try:
            search(self.launcher, self.config, arguments, self.settings)
        except ConfigError as err:
            fail(str(err))


def search_space(params: Mapping[str, Any] | None, arguments: Sequence[str]) -> SearchSpace:
    """The search of ``params`` then ``arguments``: an ``interval`` a range, another sweep a choice, else fixed."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from dpddp.entry.command_line import parsed_sweep

    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for parsed in parsed_sweep(params, arguments):
        key = parsed.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if not parsed.is_sweep_override():
            fixed[key] = str(parsed.input_line)
            continue
        value = parsed.value()
        if isinstance(value, IntervalSweep):  # its tags: search_refusal
            ints = isinstance(value.start, int) and isinstance(value.end, int)
            kind = IntDistribution if ints else FloatDistribution
            space[key] = kind(value.start, value.end, log="log" in value.tags)  # type: ignore[arg-type]
        else:
            values = parsed.sweep_iterator(transformer=Transformer.encode)
            space[key] = CategoricalDistribution(list(values))  # type: ignore[arg-type]
    return space, list(fixed.values())


def trial_overrides(number: int, params: Mapping[str, Any], space: SearchSpace) -> list[str]:
    """Trial ``number``'s overrides, the same each time. Raises ``ConfigError`` for ``params`` of another search."""
    from dpddp.errors import ConfigError

    distributions, fixed = space
    if set(params) != set(distributions):
        fix = "continue it with its own search, or give this one its own hydra.sweep.dir"
        apart = f"the study samples {', '.join(sorted(params))}, the search space {', '.join(distributions)}"
        raise ConfigError(f"trial {number} of {apart}: {fix}")
    return [f"{key}={Transformer.str(params[key])}" for key in distributions] + fixed


def job_outcome(ret: JobReturn) -> float | None:
    """A finished job's objective value, or ``None`` when it raised or returned no finite number."""
    if ret.status != JobStatus.COMPLETED or not isinstance(ret.return_value, (int, float)):
        return None
    return float(ret.return_value) if math.isfinite(ret.return_value) else None


def _runs(trials: list[Trial | FrozenTrial], size: int) -> Iterator[list[Any]]:
    """``trials`` in launches of at most ``size`` consecutive numbers (a launch numbers jobs from its first)."""
    for _, group in itertools.groupby(enumerate(trials), lambda pair: pair[1].number - pair[0]):
        run = [trial for _, trial in group]
        yield from (run[i : i + size] for i in range(0, len(run), size))


def search(launcher: Launcher, config: DictConfig, arguments: Sequence[str], settings: Mapping[str, Any]) -> None:
    """Run the search of ``settings`` over ``arguments``, trial ``n`` in ``<sweep dir>/<n>``; raises ``ConfigError``."""
    import optuna
    from optuna.trial import TrialState

    from dpddp.continuity import stop as sweep_stop
    from dpddp.entry.command_line import search_refusal
    from dpddp.entry.hydra import end_sweep, objective_of
    from dpddp.errors import ConfigError

    if line := search_refusal(settings, arguments):
        raise ConfigError(line)
    space = search_space(settings.get("params"), arguments)
    sweep_dir = Path(config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    storage = str(settings["storage"])
    study = optuna.create_study(
        storage=storage, study_name=str(settings["study_name"]), direction=settings["direction"], load_if_exists=True
    )
    earlier = study.get_trials()
    sampler = OmegaConf.create(settings["sampler"] or {"_target_": "optuna.samplers.TPESampler"})
    if sampler.get("seed") is not None and earlier:  # moved by the trials so far: no repeated samples
        sampler.seed = int(sampler.seed) + len(earlier)
    study.sampler = instantiate(sampler)
    stale = [t for t in earlier if t.state == TrialState.RUNNING]
    counts = f"{len(stale)} to continue, {max(settings['n_trials'] - len(earlier), 0)} to sample"
    log.info(f"Optuna study {study.study_name} in {storage}: {len(earlier) - len(stale)} finished trials, {counts}")

    def launch(trials: list[Any]) -> None:
        """Launch ``trials``, tell the study each value or ``FAIL`` (after a SIGTERM: an unfinished one stays)."""
        overrides = [trial_overrides(t.number, t.params, space) for t in trials]
        returns = launcher.launch(overrides, initial_job_idx=trials[0].number)
        stopped = sweep_stop.requested()
        for trial, ret in zip(trials, returns, strict=True):
            value = job_outcome(ret)
            if value is not None:
                study.tell(trial.number, value)
            elif not stopped or (sweep_dir / str(trial.number) / "error.txt").is_file():
                study.tell(trial.number, state=TrialState.FAIL)
                log.warning(f"trial {trial.number} failed (FAIL in the study; see {trial.number}/error.txt)")
        if stopped:
            end_sweep(sweep_dir, cut_short=True, objective=objective_of(config))

    for run in _runs(list(stale), settings["n_jobs"]):
        launch(run)
    while (left := settings["n_trials"] - len(study.get_trials(deepcopy=False))) > 0:
        asked = [study.ask(space[0]) for _ in range(min(left, settings["n_jobs"]))]
        for run in _runs(list(asked), settings["n_jobs"]):
            launch(run)
    try:
        best = study.best_trial
    except ValueError:  # no trial completed
        log.error("no trial completed: no best parameters (optimization_results.yaml not written)")
        return
    results = {"name": "optuna", "best_trial": best.number, "best_params": best.params, "best_value": best.value}
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
    log.info(f"Best trial: {best.number} (job {best.number}), value {best.value}, parameters {best.params}")
