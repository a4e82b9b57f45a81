"""``hydra/sweeper=dpddp_optuna`` (``dpddp.entry.sweeper.search``, imported only when a search runs)."""

from __future__ import annotations

from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from typing_extensions import override


class OptunaSweeper(Sweeper):
    """Takes ``hydra.sweeper``'s settings (the ``sampler`` config not instantiated); ``sweep`` runs the search."""

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
