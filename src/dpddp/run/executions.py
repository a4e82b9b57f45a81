"""``steps_per_execution=K`` and ``data.micro_batch_size`` (docs/design-notes.md, run.executions)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import ExitStack
from operator import itemgetter
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, RichModelSummary
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from dpddp._compat import BatchNormBase, count_logged_step, counted_step, epoch_cut, skip_next_validation
from dpddp.data.batches import DeferredRows
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.errors import ConfigError
from dpddp.models.classifier import Classifier
from dpddp.nn import select_sample_part, select_sample_row

log = logging.getLogger(__name__)

STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")  # in each optimizer step
SKIPPED_HOOKS = ("optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping", "on_before_zero_grad")
"""The module's hooks that automatic optimization calls each step and an execution's steps do not."""
BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")
KNOWN: tuple[type, ...] = (EarlyStopping, ModelSummary, RichModelSummary, ModelCheckpoint)
KNOWN += (CSVLogger, TensorBoardLogger, MLFlowLogger, WandbLogger, DummyLogger)
"""Lightning's classes, matched by exact type, whose objects see nothing an execution changes."""
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
ROWS = (torch.Tensor, DeferredRows)  # what an execution batch holds a global batch per row of


def known(obj: object) -> bool:
    """Whether ``obj`` (an instance or a class) is exactly of a dpddp class or of ``KNOWN``."""
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__module__.split(".")[0] == "dpddp" or cls in KNOWN


def execution_steps(batch: Any, steps: int) -> int:
    """The global batches a training batch carries: its leading ``k`` when ``steps`` is above 1, else 1."""
    return extract_batch_size(batch) if steps > 1 else 1


class StepsPerExecution(pl.Callback):
    """Replaces ``module``'s ``training_step`` by one optimizer step per global batch of an execution's ``steps``
    (to ``max_steps``: ``cut``), the weights equal to ``K=1``'s; ``micro`` (samples, or ``"auto"``: halved on out of
    memory) splits each step's share. Raises ``ConfigError`` where the weights could not equal K=1's."""

    def __init__(
        self,
        module: pl.LightningModule,
        steps: int,
        micro: int | str | None = None,
        *,
        clip: tuple[float | None, str | None] = (None, None),
        auto: bool = False,
    ) -> None:
        setting = f"steps_per_execution={steps}" if steps > 1 else f"data.micro_batch_size={micro}"
        self.fix = "use steps_per_execution=1" if steps > 1 else "remove data.micro_batch_size"
        if not module.automatic_optimization:
            raise ConfigError(
                f"{setting} needs a model with automatic optimization ({type(module).__name__} steps its "
                f"optimizers itself): {self.fix}"
            )
        if hook := next((h for h in SKIPPED_HOOKS if is_overridden(h, module, pl.LightningModule)), None):
            raise ConfigError(
                f"{setting} skips {type(module).__name__}.{hook}, which automatic optimization calls each step: "
                f"{self.fix}"
            )
        norms = [n for n, m in module.named_modules() if isinstance(m, BatchNormBase)]
        if micro is not None and norms:
            raise ConfigError(
                f"data.micro_batch_size={micro} with BatchNorm (model.{norms[0]}): a micro-batch's statistics are "
                "not the share's: remove data.micro_batch_size, or lower data.batch_size"
            )
        self.steps, self.module, self.cut, self.lean, self.setting = steps, module, False, False, setting
        self.clip, self.auto, self.loop_dtype = clip, auto, torch.get_default_dtype()
        self.micro, self.micro_size = micro, micro if isinstance(micro, int) else None
        self._step = module.training_step
        self._no_sync = ExitStack()
        module.automatic_optimization = False
        module.training_step = self.training_step  # type: ignore[method-assign]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One execution: ``k`` optimizer steps on the ``k`` global batches of ``batch`` (``[k, b, ...]``)."""
        module = self.module
        trainer, optimizer = module.trainer, cast(Any, module.optimizers())
        strategy = trainer.strategy
        rows = execution_steps(batch, self.steps)
        left = trainer.max_steps - trainer.global_step if trainer.max_steps >= 0 else rows
        self.cut = left < rows
        if self.cut:  # max_steps inside the execution: K=1 stops before the epoch's end, with no validation there
            skip_next_validation(trainer)
        plain = type(batch) in (tuple, list) and all(isinstance(t, ROWS) for t in batch)  # its rows without a walk
        for i in range(min(rows, left)):
            if i:
                count_logged_step(trainer)  # Lightning counts the loop iteration's first
            one = batch
            if self.steps > 1:
                select_sample_row(i)  # the sample keys of global batch i
                one = type(batch)(t[i] for t in batch) if plain else apply_to_collection(batch, ROWS, itemgetter(i))
            optimizer.zero_grad()
            lean = self.lean and self.micro is None
            if self.micro is not None:
                self._split_step(one, batch_idx)
            elif lean:
                loss = self._loss(one, batch_idx)
                strategy.pre_backward(loss)
                loss.backward()
                strategy.post_backward(loss)
            else:
                module.manual_backward(self._loss(one, batch_idx))
            if self.clip[0]:
                module.clip_gradients(optimizer, gradient_clip_val=self.clip[0], gradient_clip_algorithm=self.clip[1])
            if lean:
                counted_step(optimizer)
            else:
                optimizer.step()
            if trainer.lr_scheduler_configs:
                self._step_schedulers("step", batch_idx * self.steps + i + 1)

    def _step_schedulers(self, interval: str, count: int) -> None:
        """Step each LR scheduler of ``interval`` whose ``frequency`` divides ``count``, in the loop's dtype."""
        inside = torch.get_default_dtype()
        torch.set_default_dtype(self.loop_dtype)
        try:
            for config in self.module.trainer.lr_scheduler_configs:
                if config.interval == interval and count % config.frequency == 0:
                    self.module.lr_scheduler_step(config.scheduler, None)
        finally:
            torch.set_default_dtype(inside)

    def _loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self._step(batch, batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if loss is None:
            raise ConfigError(
                f"{self.setting}: {type(self.module).__name__}.training_step returned None (a skipped step): {self.fix}"
            )
        return loss

    def _split_step(self, batch: Any, batch_idx: int) -> None:
        """This rank's share in micro-batches (halved under ``auto`` on out of memory), then the gradients averaged."""
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
        """The mean over the ranks of every parameter's gradient, in one all-reduce."""
        if self.module.trainer.world_size == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.module.trainer.strategy.reduce(torch.cat([g.reshape(-1) for g in grads]), reduce_op="mean")
        for p, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = g.view_as(p)

    def check_observers(self, trainer: pl.Trainer, datamodule: pl.LightningDataModule) -> None:
        """``ConfigError`` (K above 1) for an object of the fit that would see executions (``auto``: not ``known``)."""
        if self.steps < 2:
            return
        module = self.module
        found: list[Any] = [module, datamodule, *trainer.callbacks, *trainer.loggers]  # type: ignore[attr-defined]
        if not known(module):
            own = module.configure_callbacks()
            found += list(own) if isinstance(own, (list, tuple)) else [own]
        for obj in (o for o in found if not known(o)):
            name = type(obj).__name__
            if self.auto:
                raise ConfigError(
                    f"steps_per_execution=auto took {self.steps}, but {name} would see executions: give "
                    "steps_per_execution=1"
                )
            parent = pl.LightningModule if isinstance(obj, pl.LightningModule) else pl.Callback
            hooks = (*BATCH_HOOKS, *STEP_HOOKS) if isinstance(obj, (pl.LightningModule, pl.Callback)) else ()
            if hook := next((h for h in hooks if is_overridden(h, obj, parent)), None):
                raise ConfigError(
                    f"{self.setting}: {name}.{hook} would see executions of {self.steps} steps, not each step (its "
                    f"logs and counts would differ from steps_per_execution=1's): {self.fix}"
                )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(pl_module).__name__
        if len(trainer.optimizers) != 1:
            raise ConfigError(
                f"{self.setting}: {name} has {len(trainer.optimizers)} optimizers; it needs one: {self.fix}"
            )
        if self.steps > 1 and trainer.lr_scheduler_configs:
            raise ConfigError(
                f"{self.setting}: {name} has an LR scheduler, and trainer.estimated_stepping_batches would count "
                f"executions: {self.fix}"
            )
        if any(config.reduce_on_plateau for config in trainer.lr_scheduler_configs):
            raise ConfigError(f"{self.setting}: {name} has a ReduceLROnPlateau scheduler: {self.fix}")
        if self.clip[0] and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ConfigError(
                f"trainer.gradient_clip_val={self.clip[0]} with {self.setting} under a gradient scaler "
                f"(trainer.precision={trainer.precision}): use trainer.precision=bf16-mixed, or {self.fix}"
            )
        # A lean step skips Lightning's per-step wrappers: plain Precision, no STEP_HOOKS (nor backward) overridden.
        wrapped: list[tuple[str, Any, type]] = [(h, pl_module, pl.LightningModule) for h in (*STEP_HOOKS, "backward")]
        wrapped += [(h, cb, pl.Callback) for cb in trainer.callbacks for h in STEP_HOOKS]  # type: ignore[attr-defined]
        self.lean = type(trainer.precision_plugin) is Precision and not any(is_overridden(*w) for w in wrapped)
        self.loop_dtype = torch.get_default_dtype()
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
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.lr_scheduler_configs and not (self.cut or epoch_cut(trainer)):  # a trained epoch's end only
            self._step_schedulers("epoch", trainer.current_epoch + 1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._no_sync.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._no_sync.close()
