"""BatchNorm over the global batch on any backend (torch's ``nn.SyncBatchNorm`` is CUDA-only), and its plugin."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import LayerSync
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from dpddp._compat import BatchNormBase
from dpddp.diagnostics.whereabouts import BATCHNORM, entering
from dpddp.errors import ConfigError
from dpddp.parallel.rules import World

log = logging.getLogger(__name__)

ORIGINAL = "_dpddp_original"  # where a converted layer keeps the module it replaced (outside ``state_dict``)


def _summed(tensor: Tensor, group: Any) -> Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    with entering(BATCHNORM):
        dist.all_reduce(out, group=group)
    return out


class _GroupSum(torch.autograd.Function):
    """A sum over ``group`` whose backward sums the gradients over ``group``."""

    @staticmethod
    @override
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _summed(tensor, group)

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _summed(grad, ctx.group), None


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class GlobalBatchNorm(BatchNormBase):
    """``nn.BatchNorm*`` whose batch statistics are over ``process_group`` (``None``: the world). Input ``[N, C, *]``.
    Raises ``ValueError``: input of fewer than 2 dims; in training, at most one value per channel globally."""

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        batch_statistics = self.training or self.running_mean is None  # eval without running statistics too
        if not batch_statistics or _group_size(self.process_group) <= 1:
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        x = input.to(torch.float64)
        count = torch.full((1,), input.numel() // max(channels, 1), dtype=torch.float64, device=input.device)
        stats = _GroupSum.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]), self.process_group)
        n = float(stats[-1].detach())
        if n <= 1:
            got = f"got {int(n)} in the global batch (input size {list(input.shape)} on this process)"
            raise ValueError(f"Expected more than 1 value per channel when training, {got}")
        mean = stats[:channels] / n
        var = (stats[channels : 2 * channels] / n - mean * mean).clamp(min=0)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.to(input.dtype).view(shape)) * torch.rsqrt(var + self.eps).to(input.dtype).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        if self.training and self.running_mean is not None and self.running_var is not None:  # as nn.BatchNorm*
            factor = 0.0 if self.momentum is None else self.momentum
            if self.num_batches_tracked is not None:  # a module may drop it, as nn.BatchNorm* allows
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                for running, batch in ((self.running_mean, mean), (self.running_var, var * (n / (n - 1)))):
                    running.copy_(factor * batch + (1 - factor) * running.to(torch.float64))
        return out


def _batchnorms(model: nn.Module) -> list[str]:
    """The qualified names of the BatchNorm modules in ``model`` (``""``: ``model`` itself)."""
    return [name for name, module in model.named_modules() if isinstance(module, BatchNormBase)]


def _lazy(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params()


def _move_state(source: nn.Module, target: nn.Module) -> None:
    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        setattr(target, name, getattr(source, name))
    target.train(source.training)


def _replace_each(model: nn.Module, swap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``model`` (or its replacement) with every module ``m`` replaced by ``swap(m)`` in place, once each."""
    replaced = functools.cache(swap)  # a module reached by several names is swapped once
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if name and (new := replaced(module)) is not module:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, new)
    return replaced(model)


def convert(module: nn.Module, cuda: bool = False) -> nn.Module:
    """``module`` with every initialised BatchNorm replaced by a ``GlobalBatchNorm`` (``cuda``: ``SyncBatchNorm``)."""
    target = nn.SyncBatchNorm if cuda else GlobalBatchNorm

    def synced(old: nn.Module) -> nn.Module:
        if not isinstance(old, BatchNormBase) or isinstance(old, target) or _lazy(old):
            return old
        new = target(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats)
        _move_state(old, new)
        if hasattr(old, "qconfig"):
            new.qconfig = old.qconfig
        new.__dict__[ORIGINAL] = old  # not a submodule: kept out of state_dict and parameters()
        return new

    return _replace_each(module, synced)


def revert(module: nn.Module) -> nn.Module:
    """Undo ``convert``, keeping the current tensors, training flag, ``eps`` and ``momentum``."""

    def original(new: nn.Module) -> nn.Module:
        old = new.__dict__.pop(ORIGINAL, None)
        if old is None:
            return new
        _move_state(new, old)
        old.eps, old.momentum = new.eps, new.momentum
        return old

    return _replace_each(module, original)


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(name or "(the model)" for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class BatchNormSync(LayerSync):
    """Lightning's ``LayerSync`` under DDP: ``sync`` converts (``cuda``: ``SyncBatchNorm``), else warns."""

    def __init__(self, sync: bool = True, cuda: bool = False, processes: int = 2) -> None:
        self.sync, self.cuda, self.processes = sync, cuda, processes

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        if self.sync:
            converted = convert(model, self.cuda)
            if lazy := [name for name, module in converted.named_modules() if _lazy(module)]:
                _warn(f"lazy BatchNorm modules not yet initialised are not synced: {_names(lazy)}")
            if untracked := [n for n in _batchnorms(converted) if converted.get_submodule(n).running_mean is None]:
                _warn(f"{_names(untracked)} keep no running statistics: test and predict use each process's own share")
            return converted
        if names := _batchnorms(model):
            own = "normalise each process's own share of the global batch, so ddp no longer trains as one process"
            given = f"trainer.sync_batchnorm=false with {self.processes} processes"
            _warn(f"{given}: {_names(names)} {own}: trainer.sync_batchnorm=null syncs them")
        return model

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert(model) if self.sync else model


_warn = rank_zero_only(log.warning)


def batchnorm_plugins(cfg: Mapping, world: World, model: nn.Module | None = None) -> list[LayerSync]:
    """``[BatchNormSync]`` under ddp over the checked ``world``'s processes, else ``[]``. Raises ``ConfigError``:
    a bad ``trainer.sync_batchnorm``, or ``strategy=dp`` over several devices with BatchNorm modules in ``model``."""
    sync = (cfg.get("trainer") or {}).get("sync_batchnorm")
    if not (sync is None or isinstance(sync, bool) or sync == "auto"):
        raise ConfigError(f"trainer.sync_batchnorm={sync!r} is invalid: use null (sync when ddp), true or false")
    devices = cfg["devices"]
    if world.family == "dp" and world.replicas > 1 and model is not None and (names := _batchnorms(model)):
        why = "each replica normalises its own chunk and its running statistics are dropped"
        fix = f"use strategy=ddp devices={devices}"
        raise ConfigError(f"strategy=dp with devices={devices} and BatchNorm modules ({_names(names)}): {why}: {fix}")
    if world.family != "ddp" or world.world_size <= 1:
        return []
    return [BatchNormSync(sync is not False, world.accelerator == "gpu", world.world_size)]
