"""Which parts of a model draw from the global random streams, watched in one training step on a real batch."""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torchmetrics import Metric

from dpddp.data.draws import streams_kept as global_streams_kept
from dpddp.data.global_batch import YieldedIds
from dpddp.errors import first_line
from dpddp.nn import SampleDropout, assign_layer_keys, sample_keys
from dpddp.report.tally import rows

PLAIN = (list, dict, set, tuple, int, float, bool, str, type(None))
PROBE_ROWS = 8  # samples of the probe batch, at most


@dataclass(frozen=True)
class Draw:
    """A module ``name`` (``model.x.y``, ``model.training_step``) that drew from ``streams``; ``kind``: of ``FIXES``."""

    name: str
    streams: tuple[str, ...]
    kind: str


FIXES = {
    "dropout": "dpddp.nn.SampleDropout(p) in place of {}",
    "attention": "dropout=0 in {} and a dpddp.nn.SampleDropout(p) on its output",
    "code": "draws keyed by the sample in {} (dpddp.nn.SampleDropout, dpddp.nn.sample_generator)",
}


def _streams() -> dict[str, Any]:
    """Each global stream's state, as a value ``==`` compares."""
    found: dict[str, Any] = {"torch": torch.default_generator.get_state().numpy().tobytes()}
    if torch.cuda.is_initialized():
        found["cuda"] = [state.numpy().tobytes() for state in torch.cuda.get_rng_state_all()]
    numpy: Any = np.random.get_state()  # ("MT19937", keys, position, ...)
    found["numpy"], found["random"] = (numpy[1].tobytes(), numpy[2]), random.getstate()
    return found


@contextmanager
def _model_kept(model: nn.Module) -> Iterator[None]:
    """``model``'s modes, buffers, metric states, ``SampleDropout`` keys and plain attributes kept."""
    internals = set(vars(nn.Module()))
    plain = {k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in vars(model).items()
             if k not in internals and isinstance(v, (*PLAIN, torch.Tensor))}  # fmt: skip
    modes = [(m, m.training) for m in model.modules()]
    buffers = {k: v.clone() for k, v in model.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}
    metrics = [(m, m.update_count, copy.deepcopy(m.metric_state)) for m in model.modules() if isinstance(m, Metric)]
    keys = [(m, m.layer_key) for m in model.modules() if isinstance(m, SampleDropout)]
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode
        if buffers:
            model.load_state_dict(buffers, strict=False)
        for metric, count, state in metrics:
            if count == 0:
                metric.reset()
            else:
                for name, value in state.items():
                    setattr(metric, name, value)
        for layer, key in keys:
            layer.layer_key = key
        model.__dict__.update(plain)  # as set, past nn.Module's and the model's own __setattr__


def global_draws(model: pl.LightningModule, batch: Any, keyed: bool) -> list[Draw]:
    """The global-stream draws of one ``training_step`` on ``batch`` (``keyed``: with sample keys); nothing changed."""
    names = {id(m): f"model.{n}" if n else "model.forward" for n, m in model.named_modules()}
    stack: list[nn.Module] = []
    seen: dict[str, tuple[nn.Module | None, set[str]]] = {}
    last = [_streams()]

    def note() -> None:
        now = _streams()
        if moved := [stream for stream, state in now.items() if last[0].get(stream) != state]:
            owner = stack[-1] if stack else None
            name = names[id(owner)] if owner is not None else "model.training_step"
            seen.setdefault(name, (owner, set()))[1].update(moved)
        last[0] = now

    def before(module: nn.Module, *args: Any) -> None:
        note()
        stack.append(module)

    def after(module: nn.Module, *args: Any) -> None:
        note()
        stack.pop()

    step, samples = type(model).training_step, rows(batch) or 0
    compiled = model.__dict__.pop("forward", None)  # compile_model's: the class's forward is watched, not traced
    with ExitStack() as scope:
        if compiled is not None:
            scope.callback(setattr, model, "forward", compiled)
        scope.enter_context(streams_kept(range(torch.cuda.device_count()) if torch.cuda.is_initialized() else ()))
        scope.enter_context(_model_kept(model))
        scope.enter_context(torch.no_grad())
        scope.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # self.log without a Trainer
        for module in model.modules():
            scope.callback(module.register_forward_pre_hook(before).remove)
            scope.callback(module.register_forward_hook(after).remove)
        if keyed and samples:
            assign_layer_keys(model)
            scope.enter_context(sample_keys(0, 0, torch.arange(samples)))
        last[0] = _streams()
        step(model, batch, 0)
        note()
    draws = []
    for name, (owner, streams) in seen.items():  # the kind by the module's attributes
        dropout = isinstance(getattr(owner, "p", None), float)
        kind = "dropout" if dropout else "attention" if isinstance(getattr(owner, "dropout", None), float) else "code"
        draws.append(Draw(name, tuple(sorted(streams)), kind))
    return draws


@contextmanager
def streams_kept(cuda: Iterable[int] = ()) -> Iterator[None]:
    """The global random streams (torch's, numpy's, Python's, CUDA devices ``cuda``'s) restored after the block."""
    with torch.random.fork_rng(devices=cuda), global_streams_kept():
        yield


def _probe_batch(datamodule: pl.LightningDataModule) -> tuple[Any, bool]:
    """A few samples of a training batch (no worker started), and whether dpddp keys its samples."""
    with streams_kept(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        datamodule.setup("fit")
        train = getattr(datamodule, "splits", {}).get("train")
        if train is not None:
            return train[torch.arange(min(PROBE_ROWS, len(train)))], True
        loader = datamodule.train_dataloader()  # data=sharded and data=stream record their ids: keyed too
        parts = (getattr(loader, name, None) for name in ("sampler", "batch_sampler", "dataset"))
        keyed = any(isinstance(part, YieldedIds) for part in parts)
        if not loader.num_workers or loader.batch_sampler is None:
            return next(iter(loader)), keyed
        ids = next(iter(loader.batch_sampler))  # no worker started for a look
        return loader.collate_fn([loader.dataset[i] for i in ids]), keyed


def find_draws(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> list[Draw] | str:
    """``global_draws`` on a few samples of a training batch, or why the step could not run (one phrase)."""
    try:
        batch, keyed = _probe_batch(datamodule)
        return global_draws(model, batch, keyed)
    except Exception as err:  # a data module or model that needs its Trainer: the caller says it could not look
        return first_line(err)


def draws_line(draws: list[Draw]) -> str:
    """``model.a, model.b (numpy) draw from the global random streams; use <the fix of each kind>``."""

    def shown(found: list[Draw]) -> str:
        named = [d.name + ("" if d.streams == ("torch",) else f" ({', '.join(d.streams)})") for d in found]
        return ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")

    kinds = {kind: [d for d in draws if d.kind == kind] for kind in FIXES}
    fixes = "; ".join(FIXES[kind].format(shown(found)) for kind, found in kinds.items() if found)
    return f"{shown(draws)} draw{'s' if len(draws) == 1 else ''} from the global random streams; use {fixes}"
