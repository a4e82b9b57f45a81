"""``steps_per_execution=K``: one Lightning loop iteration carries ``K`` global batches and takes ``K`` optimizer
steps, so the loop's fixed cost is paid once per
``K`` steps. Keras's ``steps_per_execution`` is the same idea; here it is built from Lightning's manual
optimization, so every step still goes through Lightning's backward and optimizer wrappers (precision plugins,
DDP's gradient all-reduce before each backward, the ``on_before_*`` hooks) and ``trainer.global_step`` counts
optimizer steps.

The data side is ``GlobalBatchSampler(steps_per_execution=K)``: each training item is ``[k, b]`` ids (this rank's
chunks of ``k <= K`` global batches), so every tensor of a batch has a leading ``[k, b]``.
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
    """Whether a step may skip Lightning's per-step wrappers: the precision is plain 32-bit (Lightning's base
    ``Precision``) and no callback or the module overrides a hook of ``STEP_HOOKS`` (nor the module
    ``backward``), so those wrappers would call only no-ops. On 2 CPU cores they cost about as much as a tiny
    step itself (three callback hooks, each through every callback and a profiler context: bench/)."""
    if type(trainer.precision_plugin) is not Precision:
        return False
    if any(is_overridden(hook, module, pl.LightningModule) for hook in (*STEP_HOOKS, "backward")):
        return False
    return not any(is_overridden(hook, cb, pl.Callback) for cb in trainer.callbacks for hook in STEP_HOOKS)  # type: ignore[attr-defined]


class StepsPerExecution(pl.Callback):
    """Runs ``module``'s own ``training_step`` (written for one global batch, returning its loss) ``k`` times per
    Lightning training step, each followed by ``zero_grad``, ``manual_backward`` and the optimizer's ``step``:
    what automatic optimization does per step, in the same order, so the weights equal ``K=1``'s. When
    ``lean_steps`` holds, each step calls what those wrappers would reach and nothing else: the strategy's
    ``pre_backward`` (DDP's reducer set-up) and ``post_backward``, ``loss.backward()``, and the optimizer step
    counted in ``global_step`` (``dpddp._compat.counted_step``); a profiler then sees the execution, not its steps.

    Args:
        module: a LightningModule with automatic optimization, one optimizer and no LR scheduler (checked at
            ``on_train_start``); its ``training_step`` is replaced on the instance, and its
            ``automatic_optimization`` set to ``False``.
        steps: ``K``, global batches per execution (>= 2).

    The wrapped ``training_step`` gets each global batch's tensors (``[b, ...]``: the ``[k, b, ...]`` execution
    batch indexed at ``i``) and Lightning's ``batch_idx`` of the execution. An execution stops early at
    ``trainer.max_steps``, so ``max_steps`` is exact; ``cut`` then tells the resumable state to count the cut
    execution as not done, so a continued run's loop count and the sampler's (aligned executions, the rest of
    the cut one first) agree and it ends with a straight run's weights.

    Raises:
        ConfigError: at construction, a module with manual optimization; at ``on_train_start``, more than one
            optimizer or an LR scheduler (manual optimization does not step schedulers); at a step, a
            ``training_step`` that returned ``None`` (a skipped step would leave the data ahead of
            ``global_step``).
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
