"""``hydra/sweeper=dpddp_optuna`` (``hparams_search=optuna``): dpddp's Optuna sweeper, on Optuna's ask-and-tell
interface (``dpddp.entry.sweeper.search``). Hydra imports this module whenever it composes a config (its plugin
scan), so Optuna and dpddp's sweeper code, which needs Lightning, are imported only when a search runs."""

from __future__ import annotations

from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from typing_extensions import override


class OptunaSweeper(Sweeper):
    """Takes ``hydra.sweeper``'s settings (``conf/hydra/sweeper/dpddp_optuna.yaml``: the ``sampler`` config, not
    instantiated, ``direction``, ``storage``, ``study_name``, ``n_trials``, ``n_jobs``, ``params``); ``sweep``
    runs the search through the configured launcher."""

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
        from dpddp.entry import sweeper  # here: not in every composition
        from dpddp.errors import ConfigError, fail

        assert self.launcher is not None and self.config is not None  # setup ran
        try:
            sweeper.search(self.launcher, self.config, arguments, self.settings)
        except ConfigError as err:
            fail(str(err))
