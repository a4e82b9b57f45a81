"""``steps_per_execution=K`` (as Keras's): one Lightning loop iteration carries ``K`` global batches and takes
``K`` optimizer steps through manual optimization; ``trainer.global_step`` counts optimizer steps. Every tensor
of a training batch has a leading ``[k, b]`` (``GlobalBatchSampler``). See docs/design-notes.md (run.executions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from dpddp._compat import counted_step
from dpddp.errors import ConfigError
from dpddp.nn import select_sample_row

__all__ = ["STEP_HOOKS", "StepsPerExecution", "lean_steps"]

STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
"""The hooks Lightning calls inside each optimizer step (callbacks and the module; the module's ``backward`` too)."""


def lean_steps(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Whether a step may skip Lightning's per-step wrappers: plain 32-bit ``Precision`` and no callback or module
    override of ``STEP_HOOKS`` (nor of the module's ``backward``)."""
    if type(trainer.precision_plugin) is not Precision:
        return False
    if any(is_overridden(hook, module, pl.LightningModule) for hook in (*STEP_HOOKS, "backward")):
        return False
    return not any(is_overridden(hook, cb, pl.Callback) for cb in trainer.callbacks for hook in STEP_HOOKS)  # type: ignore[attr-defined]


class StepsPerExecution(pl.Callback):
    """Runs ``module``'s ``training_step`` (one global batch ``[b, ...]``, returning its loss) for each of the
    ``k`` rows of an execution batch ``[k, b, ...]``, each followed by ``zero_grad``, backward and ``step``, so the
    weights equal ``K=1``'s. ``steps``: ``K`` (>= 2); ``module``'s ``training_step`` is replaced on the instance.
    An execution stops at ``trainer.max_steps`` and sets ``cut``.

    Raises ``ConfigError``: a module with manual optimization (at construction); more than one optimizer or an LR
    scheduler (``on_train_start``); a ``training_step`` that returned ``None``.
    """

    def __init__(self, module: pl.LightningModule, steps: int) -> None:
        if not module.automatic_optimization:
            raise ConfigError(
                f"steps_per_execution={steps} needs a model with automatic optimization ({type(module).__name__} "
                "steps its optimizers itself): use steps_per_execution=1"
            )
        self.steps, self.module, self.cut, self.lean = steps, module, False, False
        self._step = module.training_step
        module.automatic_optimization = False
        module.training_step = self.training_step  # type: ignore[method-assign]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One execution: ``k`` optimizer steps on the ``k`` global batches of ``batch`` (``[k, b, ...]``)."""
        module = self.module
        trainer, optimizer = module.trainer, module.optimizers()
        rows = extract_batch_size(batch)
        left = trainer.max_steps - trainer.global_step if trainer.max_steps >= 0 else rows
        self.cut = left < rows
        for i in range(min(rows, left)):
            select_sample_row(i)  # the sample keys of global batch i
            out = self._step(apply_to_collection(batch, torch.Tensor, lambda t: t[i]), batch_idx)  # noqa: B023
            loss = out["loss"] if isinstance(out, Mapping) else out
            if loss is None:
                raise ConfigError(
                    f"steps_per_execution={self.steps}: {type(module).__name__}.training_step returned None (a "
                    "skipped step): use steps_per_execution=1"
                )
            optimizer.zero_grad()  # type: ignore[union-attr]
            if self.lean:
                trainer.strategy.pre_backward(loss)
                loss.backward()
                trainer.strategy.post_backward(loss)
                counted_step(optimizer)
            else:
                module.manual_backward(loss)
                optimizer.step()  # type: ignore[union-attr]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(pl_module).__name__
        if len(trainer.optimizers) != 1 or trainer.lr_scheduler_configs:
            raise ConfigError(
                f"steps_per_execution={self.steps}: {name} has {len(trainer.optimizers)} optimizer(s) and "
                f"{len(trainer.lr_scheduler_configs)} LR scheduler(s); it needs one optimizer and no scheduler: "
                "use steps_per_execution=1"
            )
        self.lean = lean_steps(trainer, pl_module)
