"""``hydra/sweeper=dpddp_optuna`` (``hparams_search=optuna``): hydra-optuna-sweeper's sweeper, with a failed job
recorded as a failed trial instead of ending the search (see ``dpddp.entry.sweeper``). Defines nothing when the
optional ``[optuna]`` extra is not installed. Hydra imports this module whenever it composes a config (its plugin scan),
so dpddp's sweeper code, which needs Lightning, is imported only when the sweep is set up."""

from __future__ import annotations

import logging
from typing import Any

from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from typing_extensions import override

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # no [optuna] extra: no plugin here
    pass
else:
    log = logging.getLogger(__name__)

    class RecordingOptunaSweeper(OptunaSweeper):
        """hydra-optuna-sweeper's ``OptunaSweeper`` whose failed jobs are failed trials, not the end of the search."""

        @override
        def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
            from dpddp.entry import sweeper  # here: not in every composition (train.py devises=2 answers first)

            super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
            assert self.sweeper.launcher is not None  # the plugin's setup instantiated it
            self.recorder = sweeper.NanFailsLauncher(self.sweeper.launcher)
            self.sweeper.launcher = self.recorder

        @override
        def sweep(self, arguments: list[str]) -> Any:
            try:
                return super().sweep(arguments)
            except ValueError:
                if self.recorder.completed > 0:
                    raise
                # the plugin's study.best_trial: "No trials are completed yet."
                log.error("no trial completed: no best parameters (optimization_results.yaml not written)")
                return None
