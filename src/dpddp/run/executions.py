"""``steps_per_execution=K`` (as Keras's): one Lightning loop iteration carries ``K`` global batches and takes
``K`` optimizer steps through manual optimization; ``trainer.global_step`` counts optimizer steps. Every tensor
of a training batch has a leading ``[k, b]`` (``GlobalBatchSampler``). ``data.micro_batch_size=N|auto``: each
step's share runs in micro-batches whose gradients accumulate into its one optimizer step. See
docs/design-notes.md (run.executions).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from dpddp._compat import BatchNormBase, counted_step, skip_next_validation
from dpddp.data.batches import DeferredRows
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.errors import ConfigError
from dpddp.models.classifier import Classifier
from dpddp.nn import select_sample_part, select_sample_row

__all__ = ["SKIPPED_HOOKS", "STEP_HOOKS", "StepsPerExecution", "execution_steps", "lean_steps", "skipped_hook"]

log = logging.getLogger(__name__)

STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
"""The hooks Lightning calls inside each optimizer step (callbacks and the module; the module's ``backward`` too)."""
SKIPPED_HOOKS = ("optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping", "on_before_zero_grad")
"""The module's hooks that automatic optimization calls each step and an execution's steps do not."""
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
"""The batch hooks of a module or data module, which would see an execution's ``DeferredRows``."""


def skipped_hook(module: pl.LightningModule) -> str | None:
    """The first of ``SKIPPED_HOOKS`` that ``module`` overrides, or ``None``."""
    return next((hook for hook in SKIPPED_HOOKS if is_overridden(hook, module, pl.LightningModule)), None)


def execution_steps(batch: Any, steps: int) -> int:
    """The global batches a training batch carries: an execution's leading ``k`` (a ``DeferredRows``' too) under
    ``steps_per_execution`` ``steps`` above 1, else 1."""
    return extract_batch_size(batch) if steps > 1 else 1


def lean_steps(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Whether a step may skip Lightning's per-step wrappers: plain 32-bit ``Precision`` and no callback or module
    override of ``STEP_HOOKS`` (nor of the module's ``backward``)."""
    if type(trainer.precision_plugin) is not Precision:
        return False
    if any(is_overridden(hook, module, pl.LightningModule) for hook in (*STEP_HOOKS, "backward")):
        return False
    return not any(is_overridden(hook, cb, pl.Callback) for cb in trainer.callbacks for hook in STEP_HOOKS)  # type: ignore[attr-defined]


def _step_rows(batch: Any, i: int) -> Any:
    """Global batch ``i`` of an execution batch: row ``i`` of every tensor (a ``DeferredRows`` gathers it); a plain
    tuple or list of them without ``apply_to_collection``'s walk, microseconds a step on tiny steps."""
    if type(batch) in (tuple, list) and all(isinstance(t, (torch.Tensor, DeferredRows)) for t in batch):
        return type(batch)(t[i] for t in batch)
    return apply_to_collection(batch, (torch.Tensor, DeferredRows), lambda t: t[i])


class StepsPerExecution(pl.Callback):
    """Runs ``module``'s ``training_step`` (one global batch ``[b, ...]``, returning its loss) for each of the
    ``k`` rows of an execution batch ``[k, b, ...]`` (``steps`` >= 2; with 1, the batch is one global batch),
    each followed by ``zero_grad``, backward and ``step``, so the weights equal ``K=1``'s; ``module``'s
    ``training_step`` is replaced on the instance. An execution stops at ``trainer.max_steps`` and sets ``cut``.

    ``micro``: ``None``, a sample count ``N``, or ``"auto"``. With it each step runs this rank's share ``n`` in
    micro-batches of at most ``N`` samples, each loss (a mean over its batch) backpropagated with weight
    ``len / n`` and no gradient sync, then the gradients averaged over the ranks once (32-bit), then ``step``.
    ``"auto"`` starts from the whole share; when ``torch.OutOfMemoryError`` is raised on any rank, every rank
    learns it from one all-reduce of the flag per step, discards the step's gradients and retries it with half
    the micro-batch size, which it keeps (``micro_size``; logged).

    Raises ``ConfigError``: a module with manual optimization, or with BatchNorm and ``micro`` (at construction);
    more than one optimizer or an LR scheduler (``on_train_start``); a ``training_step`` that returned ``None``.
    ``torch.OutOfMemoryError``: ``"auto"`` out of memory with micro-batches of one sample.
    """

    def __init__(self, module: pl.LightningModule, steps: int, micro: int | str | None = None) -> None:
        setting = f"steps_per_execution={steps}" if steps > 1 else f"data.micro_batch_size={micro}"
        self.fix = "use steps_per_execution=1" if steps > 1 else "remove data.micro_batch_size"
        if not module.automatic_optimization:
            raise ConfigError(
                f"{setting} needs a model with automatic optimization ({type(module).__name__} steps its "
                f"optimizers itself): {self.fix}"
            )
        if hook := skipped_hook(module):
            raise ConfigError(
                f"{setting} skips {type(module).__name__}.{hook}, which automatic optimization calls each step: "
                f"{self.fix}"
            )
        norms = [n for n, m in module.named_modules() if isinstance(m, BatchNormBase)]
        if micro is not None and norms:
            raise ConfigError(
                f"data.micro_batch_size={micro} with BatchNorm (model.{norms[0]}): a micro-batch's statistics are "
                "not the share's, so the weights would depend on the split: remove data.micro_batch_size, or lower "
                "data.batch_size"
            )
        self.steps, self.module, self.cut, self.lean, self.setting = steps, module, False, False, setting
        self.micro, self.micro_size = micro, micro if isinstance(micro, int) else None
        self._step = module.training_step
        self._no_sync = ExitStack()
        module.automatic_optimization = False
        module.training_step = self.training_step  # type: ignore[method-assign]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One execution: ``k`` optimizer steps on the ``k`` global batches of ``batch`` (``[k, b, ...]``)."""
        module = self.module
        trainer, optimizer = module.trainer, module.optimizers()
        strategy = trainer.strategy
        rows = execution_steps(batch, self.steps)
        left = trainer.max_steps - trainer.global_step if trainer.max_steps >= 0 else rows
        self.cut = left < rows
        if self.cut:  # max_steps inside the execution: K=1 stops before the epoch's end, with no validation there
            skip_next_validation(trainer)
        for i in range(min(rows, left)):
            one = batch
            if self.steps > 1:
                select_sample_row(i)  # the sample keys of global batch i
                one = _step_rows(batch, i)
            optimizer.zero_grad()  # type: ignore[union-attr]
            if self.micro is not None:
                self._split_step(one, batch_idx)
                optimizer.step()  # type: ignore[union-attr]
                continue
            loss = self._loss(one, batch_idx)
            if self.lean:
                strategy.pre_backward(loss)
                loss.backward()
                strategy.post_backward(loss)
                counted_step(optimizer)
            else:
                module.manual_backward(loss)
                optimizer.step()  # type: ignore[union-attr]

    def _loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self._step(batch, batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if loss is None:
            raise ConfigError(
                f"{self.setting}: {type(self.module).__name__}.training_step returned None (a skipped step): {self.fix}"
            )
        return loss

    def _split_step(self, batch: Any, batch_idx: int) -> None:
        """This rank's share ``batch`` in micro-batches, gradients accumulated (see the class); retried smaller
        under ``"auto"`` when any rank ran out of memory."""
        module, trainer, n = self.module, self.module.trainer, extract_batch_size(batch)
        if self.micro_size is None:  # auto: the whole share first
            self.micro_size = n
        while True:
            size = min(self.micro_size, n)
            mark = module.train_loss_mark() if isinstance(module, Classifier) else None
            failed = False
            try:
                for start in range(0, n, size):
                    part = (start, min(n, start + size))
                    select_sample_part(part)
                    micro = apply_to_collection(batch, torch.Tensor, lambda t: t[part[0] : part[1]])  # noqa: B023
                    module.manual_backward(self._loss(micro, batch_idx) * ((part[1] - part[0]) / n))
            except torch.OutOfMemoryError:
                if self.micro != "auto" or size == 1:
                    raise
                failed = True  # the traceback, and the step's tensors with it, are freed here
            finally:
                select_sample_part(None)
            if self.micro != "auto" or not trainer.strategy.reduce_boolean_decision(failed, all=False):
                break
            module.zero_grad(set_to_none=True)
            if isinstance(module, Classifier) and mark is not None:
                module.rewind_train_loss(mark)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.micro_size = -(-size // 2)
            if trainer.is_global_zero:
                log.warning(
                    f"data.micro_batch_size=auto: out of memory on a rank with micro-batches of {size} samples; "
                    f"every rank now runs its share of {n} in micro-batches of {self.micro_size} (kept)"
                )
        self._average_gradients()

    def _average_gradients(self) -> None:
        """The mean over the ranks of every parameter's gradient, in one all-reduce of their dtype (32-bit)."""
        strategy = self.module.trainer.strategy
        if self.module.trainer.world_size == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = strategy.reduce(torch.cat([g.reshape(-1) for g in grads]), reduce_op="mean")
        for p, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = g.view_as(p)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(pl_module).__name__
        if len(trainer.optimizers) != 1 or trainer.lr_scheduler_configs:
            raise ConfigError(
                f"{self.setting}: {name} has {len(trainer.optimizers)} optimizer(s) and "
                f"{len(trainer.lr_scheduler_configs)} LR scheduler(s); it needs one optimizer and no scheduler: "
                f"{self.fix}"
            )
        self.lean = lean_steps(trainer, pl_module)
        data = trainer.datamodule  # type: ignore[attr-defined]
        if self.steps > 1 and self.lean and isinstance(data, GlobalBatchDataModule):
            hooked = any(
                is_overridden(hook, pl_module, pl.LightningModule) or is_overridden(hook, data, pl.LightningDataModule)
                for hook in TRANSFER_HOOKS
            )
            if not hooked:
                data.defer_training_rows()
        if self.micro is not None and trainer.world_size > 1:  # gradients are averaged once a step, after the split
            self._no_sync.enter_context(trainer.strategy.block_backward_sync())  # type: ignore[attr-defined]

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._no_sync.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._no_sync.close()
