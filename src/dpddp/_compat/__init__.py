"""Every private Lightning, torch and Hydra name dpddp relies on, with the version checked; tests/test_compat.py
fails when one moves (docs/design-notes.md, _compat)."""

from __future__ import annotations

import argparse
import math
import os
import socket
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment

# Lightning 2.6.6, as its DDPStrategy.setup_distributed uses them.
from lightning.fabric.utilities.distributed import _init_dist_connection, _set_num_threads_if_needed
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3

# Lightning 2.6.6: `_call_and_handle_interrupt` kills the children of a launcher of this type on Ctrl-C.
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage

CHECKED = {"lightning": "2.6.6", "torch": "2.13.0", "hydra-core": "1.3.8"}
"""The versions every entry below was read in and tested against."""

SubprocessScriptLauncher = _SubprocessScriptLauncher
Launcher = _Launcher
set_num_threads_if_needed = _set_num_threads_if_needed

HOOK_NAME_ATTRIBUTE = "_current_fx_name"
"""Lightning 2.6.6's ``LightningModule._current_fx_name``, set around every hook call."""


def resolve_process_group_backend(strategy: pl.strategies.DDPStrategy) -> str:
    """Lightning 2.6.6's ``DDPStrategy._get_process_group_backend()``, stored as ``setup_distributed`` does."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    return strategy._process_group_backend


def init_process_group(
    env: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device, store: Any = None
) -> None:
    """Lightning 2.6.6's ``_init_dist_connection`` as ``DDPStrategy.setup_distributed`` calls it, with ``store``."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if store is not None:
        kwargs["store"] = store
    if _TORCH_GREATER_EQUAL_2_3:
        kwargs["device_id"] = device if device.type != "cpu" else None
    _init_dist_connection(env, backend, **kwargs)


def rank0_store(sock: socket.socket, world_size: int, timeout: timedelta) -> torch.distributed.Store:
    """Rank 0's store on ``sock`` (torch 2.13's ``TCPStore(master_listen_fd=...)`` in ``env://``'s prefix)."""
    address, port = sock.getsockname()[:2]
    store = torch.distributed.TCPStore(
        address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=False,
    )  # fmt: skip
    return torch.distributed.PrefixStore("default_pg", store)


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to ``"True"`` by torch 2.13's ``LocalElasticAgent._start_workers`` when the master is the agent's store."""


def agent_store_shared() -> bool:
    """Whether torchrun handed this worker its agent's store (``AGENT_STORE_ENV``)."""
    return os.environ.get(AGENT_STORE_ENV) == str(True)


def agent_store(address: str, port: int, timeout: timedelta) -> torch.distributed.Store | None:
    """A client of torchrun's agent store when this worker was handed one, else ``None`` (torch 2.13)."""
    if not agent_store_shared():
        return None
    return torch.distributed.TCPStore(address, port, is_master=False, timeout=timeout)


def _present(owner: Any, name: str) -> None:
    if not hasattr(owner, name):
        raise RuntimeError(f"lightning moved {type(owner).__name__}.{name}: update dpddp._compat")


def disable_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Turn off Lightning 2.6.6's ``_broadcast_sigterm_tensor`` and ``_sigterm_notifier_fn`` for ``trainer``."""
    loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
    _present(loop, "_broadcast_sigterm_tensor")
    _present(connector, "_sigterm_notifier_fn")
    loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]
    connector._sigterm_notifier_fn = lambda signum, _: None  # type: ignore[method-assign]


def restore_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Undo ``disable_sigterm_broadcast``'s per-step broadcast (Lightning 2.6.6; the notifier stays quiet)."""
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def data_position(trainer: pl.Trainer, length: int | None = None) -> tuple[int, int]:
    """``(epoch, batches of it trained)`` (Lightning 2.6.6's ``batch_progress.total``, ``_parse_num_batches``)."""
    per_epoch = trainer.num_training_batches
    if per_epoch == float("inf") and length:
        per_epoch = _parse_num_batches(RunningStage.TRAINING, length, trainer.limit_train_batches)
    if not per_epoch or per_epoch == float("inf"):
        return trainer.current_epoch, 0
    total = trainer.fit_loop.epoch_loop.batch_progress.total
    done = max(total.completed, getattr(total, "processed", 0))  # a _ProcessedTracker, typed as its base
    return divmod(int(done), int(per_epoch))


def keep_unfinished_epoch(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Mark an epoch the fit cut as unfinished in ``checkpoint`` (Lightning 2.6.6's ``fit_loop`` ``epoch_progress``)."""
    if epoch_cut(trainer):
        _unfinish_epoch(checkpoint)


def epoch_cut(trainer: pl.Trainer) -> bool:
    """Whether the fit leaves the epoch before its last batch (Lightning 2.6.6's ``batch_progress.current``)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
    return bool(done < trainer.num_training_batches)


def _unfinish_epoch(checkpoint: dict[str, Any]) -> None:
    progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for part in ("total", "current"):  # the epoch started (ready, started) and is neither processed nor completed
        progress[part]["processed"] = progress[part]["completed"] = progress[part]["started"] - 1


def uncount_last_batch(checkpoint: dict[str, Any]) -> None:
    """Count ``checkpoint``'s last loop iteration as not done, its epoch unfinished (Lightning 2.6.6's loops)."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for part in ("total", "current"):
        for key in ("ready", "started", "processed", "completed"):
            progress[part][key] -= 1
    progress["is_last_batch"] = False
    _unfinish_epoch(checkpoint)


def step_count_either_way(checkpoint: dict[str, Any]) -> None:
    """Set both optimization modes' step counters of ``checkpoint``'s fit loop to ``global_step`` (Lightning 2.6.6)."""
    loops, step = checkpoint.get("loops", {}).get("fit_loop"), checkpoint.get("global_step")
    if not loops or not isinstance(step, int):
        return
    automatic = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    manual = loops["epoch_loop.manual_optimization.optim_step_progress"]["total"]
    for total in (automatic, manual):
        total["ready"] = total["completed"] = step


def batches_counted_as_steps(checkpoint: dict[str, Any]) -> None:
    """Set ``checkpoint``'s ``batch_progress.total`` counters to its ``global_step`` (Lightning 2.6.6)."""
    total = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    for key in total:
        total[key] = int(checkpoint["global_step"])


def counted_step(optimizer: Any) -> None:
    """Lightning 2.6.6's ``LightningOptimizer.step`` without its wrappers (``_on_after_step`` counts the step)."""
    optimizer._on_before_step()
    optimizer.optimizer.step()
    optimizer._on_after_step()


def epoch_finished_in(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` records the current epoch as trained (Lightning 2.6.6's ``batch_progress``)."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    return bool(progress["current"]["processed"] >= trainer.num_training_batches)


def processed_epochs(checkpoint: dict[str, Any]) -> int | None:
    """Lightning 2.6.6's ``fit_loop`` ``epoch_progress.current.processed`` of ``checkpoint``, else ``None``."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    done = loop.get("epoch_progress", {}).get("current", {}).get("processed")
    return done if isinstance(done, int) else None


def skip_next_validation(trainer: pl.Trainer) -> None:
    """Skip the validation due after this batch (Lightning 2.6.6's ``_skip_next_val``); ``RuntimeError`` if moved."""
    loop = trainer.fit_loop.epoch_loop
    _present(loop, "_skip_next_val")
    loop._skip_next_val = True


def count_logged_step(trainer: pl.Trainer) -> None:
    """One more step on the loggers' axis (Lightning 2.6.6's ``_batches_that_stepped``); ``RuntimeError`` if moved."""
    loop = trainer.fit_loop.epoch_loop
    _present(loop, "_batches_that_stepped")
    loop._batches_that_stepped += 1


def restart_train_iterator(trainer: pl.Trainer) -> None:
    """Remake the loader's iterator unless the epoch loop does (Lightning 2.6.6's ``fit_loop._data_fetcher``)."""
    loop = trainer.fit_loop
    if not hasattr(loop, "_data_fetcher"):
        raise RuntimeError("lightning moved _FitLoop._data_fetcher: update dpddp._compat")
    if trainer.current_epoch > 0 and not loop.is_resuming and not loop.epoch_loop.restarting:
        return  # the epoch loop makes it
    if loop._data_fetcher is not None:
        iter(loop._data_fetcher)


def logged_metric_kinds(trainer: pl.Trainer) -> dict[str, tuple[bool, bool]]:
    """``{name: (is a torchmetrics Metric, sync_dist)}`` logged in the loop (Lightning 2.6.6's ``_results``)."""
    results = trainer._results
    found: dict[str, tuple[bool, bool]] = {}
    for value in (results or {}).values():
        meta = getattr(value, "meta", None)
        if meta is not None:
            found[meta.name] = (not value.is_tensor, bool(meta.sync.should))
    return found


def logged_tensor_states(trainer: pl.Trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``{key: (value, batch size or None)}`` of the tensors logged in the loop (Lightning 2.6.6's ``_results``)."""
    found: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for key, value in (trainer._results or {}).items():
        if getattr(value, "is_tensor", False):
            count = getattr(value, "cumulated_batch_size", None)
            found[key] = (value.value.clone(), count.clone() if count is not None else None)
    return found


def restore_logged_tensors(trainer: pl.Trainer, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Put the logged tensors back to ``states`` (Lightning 2.6.6's ``_ResultMetric``); one logged since: empty."""
    for key, value in (trainer._results or {}).items():
        if not getattr(value, "is_tensor", False):
            continue
        if key in states:
            value.value, count = states[key][0].clone(), states[key][1]
        else:
            meta = value.meta
            empty = -math.inf if meta.is_max_reduction else math.inf if meta.is_min_reduction else 0.0
            value.value, count = torch.full_like(value.value, empty), None
        if (before := getattr(value, "cumulated_batch_size", None)) is not None:
            value.cumulated_batch_size = count.clone() if count is not None else torch.zeros_like(before)


def float_batch_counts(trainer: pl.Trainer) -> None:
    """Make the logged tensors' ``cumulated_batch_size`` (Lightning 2.6.6, int64) float64 before ``compute``."""
    for value in (trainer._results or {}).values():
        count = getattr(value, "cumulated_batch_size", None)
        if getattr(value, "is_tensor", False) and count is not None and not torch.is_floating_point(count):
            value.cumulated_batch_size = count.to(torch.float64)


def _softmax_per_sample(tensor: torch.Tensor, normalization: Any, original: Any) -> torch.Tensor:
    if normalization != "softmax" or tensor.dim() < 2:
        return original(tensor, normalization)
    in_range = ((tensor >= 0) & (tensor <= 1)).all(dim=1, keepdim=True)
    sums_to_one = (tensor.sum(dim=1, keepdim=True) - 1).abs() <= 1e-4
    return torch.where(in_range & sums_to_one, tensor, tensor.softmax(dim=1))


def softmax_per_sample() -> None:
    """Make torchmetrics 1.9's ``normalize_logits_if_needed(preds, "softmax")`` decide per sample, in the modules
    that call it (AUROC, AveragePrecision, ROC, ..., calibration error, hinge); idempotent."""
    import importlib
    from functools import partial

    for name in ("precision_recall_curve", "calibration_error", "hinge"):
        module = importlib.import_module(f"torchmetrics.functional.classification.{name}")
        current = module.normalize_logits_if_needed
        if not isinstance(current, partial):
            module.normalize_logits_if_needed = partial(_softmax_per_sample, original=current)  # type: ignore[attr-defined]


PER_BATCH_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip
"""The hooks Lightning 2.6.6 calls every batch, through ``trainer.call._call_callback_hooks`` only."""


def skip_empty_batch_hooks(callbacks: Iterable[pl.Callback]) -> None:
    """Set the ``PER_BATCH_HOOKS`` a callback does not override to ``None`` (Lightning 2.6.6 skips them)."""
    for callback in callbacks:
        for name in PER_BATCH_HOOKS:
            if getattr(type(callback), name, None) is getattr(pl.Callback, name):
                callback.__dict__[name] = None


def hydra_command_line(argv: list[str]) -> argparse.Namespace | None:
    """``argv`` as hydra-core 1.3.8's ``get_args_parser`` reads it; ``None`` where it refuses or acts on it."""
    from hydra._internal.utils import get_args_parser

    if "--version" in argv:
        return None
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        return parser.parse_known_args(argv)[0]
    except argparse.ArgumentError:
        return None


def hydra_mode_unset() -> AbstractContextManager[Any]:
    """Inside it, hydra-core 1.3.8's ``Hydra.get_mode`` returns ``None`` without composing."""
    from unittest.mock import patch

    from hydra._internal.hydra import Hydra

    return patch.object(Hydra, "get_mode", lambda self, config_name, overrides: None)


def hydra_override_refused(refused: Callable[[Any, Any, Exception], None]) -> AbstractContextManager[Any]:
    """Inside it, hydra-core 1.3.8's ``ConfigLoaderImpl._apply_overrides_to_config`` calls ``refused(override,
    cfg, err)`` before it raises."""
    from unittest.mock import patch

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException

    apply = ConfigLoaderImpl.__dict__["_apply_overrides_to_config"]

    def one_at_a_time(overrides: list[Any], cfg: Any) -> None:
        for override in overrides:
            try:
                apply.__func__([override], cfg)
            except ConfigCompositionException as err:
                refused(override, cfg, err)
                raise

    return patch.object(ConfigLoaderImpl, "_apply_overrides_to_config", staticmethod(one_at_a_time))


BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
"""torch 2.13's ``_BatchNorm``, base of every BatchNorm."""


HYDRA_BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
"""The ``_target_`` of hydra-core 1.3.8's basic launcher."""
