"""Every private Lightning, torch and Hydra name dpddp relies on, with the version checked (tests/test_compat.py)."""

from __future__ import annotations

import argparse
import importlib
import math
import multiprocessing.forkserver
import multiprocessing.resource_sharer
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn
from unittest.mock import patch

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from hydra._internal import utils as hydra_utils
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from lightning.fabric.plugins import ClusterEnvironment

# Lightning 2.6.6, as its DDPStrategy.setup_distributed uses them.
from lightning.fabric.utilities.distributed import _init_dist_connection, _set_num_threads_if_needed
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

# Lightning 2.6.6: `_call_and_handle_interrupt` kills the children of a launcher of this type on Ctrl-C.
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

CHECKED = {"lightning": "2.6.6", "torch": "2.13.0", "hydra-core": "1.3.8"}  # every entry below was tested in these

SubprocessScriptLauncher = _SubprocessScriptLauncher
Launcher = _Launcher
set_num_threads_if_needed = _set_num_threads_if_needed

HOOK_NAME_ATTRIBUTE = "_current_fx_name"  # Lightning 2.6.6 sets it on the LightningModule around every hook call


def resolve_process_group_backend(strategy: DDPStrategy) -> str:
    """Lightning 2.6.6's ``DDPStrategy._get_process_group_backend()``, stored as ``setup_distributed`` does."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    return strategy._process_group_backend


def init_process_group(
    env: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device, store: Any = None
) -> None:
    """Lightning 2.6.6's ``_init_dist_connection`` as ``DDPStrategy.setup_distributed`` calls it, with ``store``."""
    device_id = device if device.type != "cpu" else None  # as Lightning's, torch >= 2.3
    extra = {"store": store} if store is not None else {}
    _init_dist_connection(env, backend, timeout=timeout, device_id=device_id, **extra)


def rank0_store(sock: socket.socket, world_size: int, timeout: timedelta) -> torch.distributed.Store:
    """Rank 0's store on ``sock`` (torch 2.13's ``TCPStore(master_listen_fd=...)`` in ``env://``'s prefix)."""
    address, port = sock.getsockname()[:2]
    store = torch.distributed.TCPStore(
        address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=False,
    )  # fmt: skip
    return torch.distributed.PrefixStore("default_pg", store)


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # "True": torch 2.13's LocalElasticAgent shares its store


def agent_store_shared() -> bool:
    """Whether torchrun handed this worker its agent's store (``AGENT_STORE_ENV``)."""
    return os.environ.get(AGENT_STORE_ENV) == str(True)


def agent_store(address: str, port: int, timeout: timedelta) -> torch.distributed.Store | None:
    """A client of torchrun's agent store when this worker was handed one, else ``None`` (torch 2.13)."""
    shared = agent_store_shared()
    return torch.distributed.TCPStore(address, port, is_master=False, timeout=timeout) if shared else None


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
    ours = trainer.current_epoch == 0 or loop.is_resuming or loop.epoch_loop.restarting  # else the epoch loop's
    if ours and loop._data_fetcher is not None:
        iter(loop._data_fetcher)


def logged_metric_kinds(trainer: pl.Trainer) -> dict[str, tuple[bool, bool]]:
    """``{name: (is a torchmetrics Metric, sync_dist)}`` logged in the loop (Lightning 2.6.6's ``_results``)."""
    found: dict[str, tuple[bool, bool]] = {}
    for value in (trainer._results or {}).values():
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
            empty = -math.inf if value.meta.is_max_reduction else math.inf if value.meta.is_min_reduction else 0.0
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
    """Make torchmetrics 1.9's ``normalize_logits_if_needed(preds, "softmax")`` decide per sample; idempotent."""
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


def _hydra_parser() -> argparse.ArgumentParser:
    """hydra-core 1.3.8's ``get_args_parser``, raising ``argparse.ArgumentError`` where it would exit."""
    parser = hydra_utils.get_args_parser()

    def refuse(message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def hydra_command_line(argv: list[str]) -> argparse.Namespace | None:
    """``argv`` as Hydra's parser reads it; ``None`` where it refuses or acts on it (``--version``)."""
    try:
        return None if "--version" in argv else _hydra_parser().parse_known_args(argv)[0]
    except argparse.ArgumentError:
        return None


def hydra_argument_error(argv: list[str]) -> str | None:
    """argparse's message where Hydra's parser refuses ``argv``; ``None`` where it reads it."""
    try:
        if "--version" not in argv:
            _hydra_parser().parse_args(argv)
    except argparse.ArgumentError as err:
        return str(err)
    return None


def hydra_mode_unset() -> AbstractContextManager[Any]:
    """Inside it, hydra-core 1.3.8's ``Hydra.get_mode`` returns ``None`` without composing."""
    return patch.object(Hydra, "get_mode", lambda self, config_name, overrides: None)


def hydra_override_refused(refused: Callable[[Any, Any, Exception], None]) -> AbstractContextManager[Any]:
    """Inside it, Hydra 1.3.8's ``_apply_overrides_to_config`` calls ``refused(override, cfg, err)``, then raises."""
    apply = ConfigLoaderImpl.__dict__["_apply_overrides_to_config"]

    def one_at_a_time(overrides: list[Any], cfg: Any) -> None:
        for override in overrides:
            try:
                apply.__func__([override], cfg)
            except ConfigCompositionException as err:
                refused(override, cfg, err)
                raise

    return patch.object(ConfigLoaderImpl, "_apply_overrides_to_config", staticmethod(one_at_a_time))


BatchNormBase = torch.nn.modules.batchnorm._BatchNorm  # torch 2.13's base of every BatchNorm
HYDRA_BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"  # hydra-core 1.3.8's _target_


@contextmanager
def hydra_reported(report: Callable[[Exception], None], kinds: tuple[type[Exception], ...]) -> Iterator[None]:
    """Inside it, Hydra's ``run_and_report`` and ``show_info`` call ``report(err)`` first for an error of ``kinds``."""
    run_and_report, show_info = hydra_utils.run_and_report, Hydra.show_info

    def composed_first(self: Any, info: str, config_name: Any, overrides: list[str], *args: Any) -> None:
        try:
            self.compose_config(config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=False)
        except kinds as err:
            report(err)
        except Exception:
            pass  # as without the block: Hydra's own --info says it
        show_info(self, info, config_name, overrides, *args)

    def reported(func: Any) -> Any:
        def call() -> Any:
            try:
                return func()
            except kinds as err:
                report(err)
                raise

        return run_and_report(call)

    hydra_utils.run_and_report, Hydra.show_info = reported, composed_first  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        hydra_utils.run_and_report, Hydra.show_info = run_and_report, show_info  # type: ignore[method-assign]


# What ``_target_: <path>`` builds, without get_class's log lines (ImportError, ValueError).
locate = hydra_utils._locate


# Lightning 2.6.6: the strategy registry, DDPStrategy._ddp_kwargs, callbacks' internals.
def registered_strategies() -> dict[str, tuple[type, dict[str, Any]]]:
    """``{name: (strategy class, the arguments the name gives it)}`` of Lightning's ``StrategyRegistry``."""
    return {
        name: (StrategyRegistry[name]["strategy"], dict(StrategyRegistry[name]["init_params"]))
        for name in StrategyRegistry.available_strategies()
    }


@contextmanager
def wrapping_frozen(strategy: DDPStrategy, module: torch.nn.Module) -> Iterator[None]:
    """Inside it, ``strategy`` wraps ``module``'s frozen parameters in DDP too (through ``_ddp_kwargs``)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    if frozen:
        strategy._ddp_kwargs["find_unused_parameters"] = True
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def swapped_average(checkpoint: dict[str, Any]) -> tuple[str, int] | None:
    """``(state key, epochs averaged)`` of the SWA whose average of 2+ epochs ``checkpoint``'s weights are, or None."""
    weights = checkpoint.get("state_dict") or {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not isinstance(state, dict) or not {"n_averaged", "average_model_state"} <= state.keys():
            continue
        average, count = state["average_model_state"] or {}, int(state["n_averaged"] or 0)
        tensors = {k: v for k, v in average.items() if isinstance(v, torch.Tensor)}
        if count >= 2 and tensors and all(k in weights and torch.equal(weights[k], v) for k, v in tensors.items()):
            return key, count
    return None


def mend_finetuning(callback: BaseFinetuning) -> None:
    """Make a continued fit unfreeze again the modules of the param groups ``callback`` had added (``_restarting``)."""
    restore = callback.on_fit_start

    def on_fit_start(trainer: Any, pl_module: Any) -> None:
        own = [len(optimizer.param_groups) for optimizer in trainer.optimizers]
        restarting = bool(callback._restarting)
        restore(trainer, pl_module)
        if not restarting:
            return
        groups = [group for n, o in zip(own, trainer.optimizers, strict=True) for group in o.param_groups[n:]]
        added = {id(p) for group in groups for p in group["params"]}
        owners = [m for m in pl_module.modules() if any(id(p) in added for p in m.parameters(recurse=False))]
        BaseFinetuning.make_trainable(owners)

    callback.on_fit_start = on_fit_start  # type: ignore[method-assign]


def mend_swa(callback: StochasticWeightAveraging) -> None:
    """Run ``callback``'s ``SWALR`` set-up when a fit continues mid-epoch in its window (Lightning skips it)."""
    own = callback.on_train_start

    def on_train_start(trainer: Any, pl_module: Any) -> None:
        own(trainer, pl_module)
        in_window = callback.swa_start <= trainer.current_epoch <= callback.swa_end
        if trainer.fit_loop.restarted_mid_epoch and in_window:
            callback.on_train_epoch_start(trainer, pl_module)

    callback.on_train_start = on_train_start  # type: ignore[method-assign]


# torch 2.13: PowerSGD's hook state, DDP's bucket assignment.
POWERSGD_FIELDS = ("rng", "error_dict", "p_memory_dict", "q_memory_dict", "iter")  # those that change as it runs


def powersgd_state(state: PowerSGDState) -> dict[str, Any]:
    """``POWERSGD_FIELDS`` of ``state``, tensors on the CPU, the numpy generator's keys as a tensor."""
    kind, keys, pos, has_gauss, gauss = state.rng.get_state(legacy=True)
    out: dict[str, Any] = {"rng": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss]}
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        out[name] = {int(k): v.detach().cpu().clone() for k, v in getattr(state, name).items()}
    out["iter"] = int(state.iter)
    return out


def load_powersgd_state(state: PowerSGDState, saved: dict[str, Any], device: torch.device) -> None:
    """Put a ``powersgd_state`` back into ``state`` (its tensors on ``device``)."""
    kind, keys, pos, has_gauss, gauss = saved["rng"]
    state.rng.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        setattr(state, name, {int(k): v.to(device) for k, v in saved[name].items()})
    state.iter = int(saved["iter"])


@contextmanager
def bucket_assignment(layout: list[list[int]] | None) -> Iterator[list[torch.Tensor]]:
    """Inside it, a DDP built gets the buckets ``layout`` (``None``: its own); yields its parameters once built."""
    real = dist._compute_bucket_assignment_by_size
    seen: list[torch.Tensor] = []

    def assign(parameters: list[torch.Tensor], limits: list[int], *args: Any, **kwargs: Any) -> Any:
        seen[:] = parameters
        indices, per_bucket = real(parameters, limits, *args, **kwargs)
        if layout is None or sorted(i for b in layout for i in b) != list(range(len(parameters))):
            return indices, per_bucket
        return list(reversed(layout)), [max(per_bucket)] * len(layout)

    setattr(dist, "_compute_bucket_assignment_by_size", assign)  # noqa: B010
    try:
        yield seen
    finally:
        setattr(dist, "_compute_bucket_assignment_by_size", real)  # noqa: B010


# CPython 3.11.7's multiprocessing (DataLoader workers' helpers; docs/design-notes.md, parallel.workers).
FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"  # how ForkServer's python -c command begins


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server or a worker it forked."""
    return sys.orig_argv[-2:-1] == ["-c"] and sys.orig_argv[-1].startswith(FORK_SERVER_COMMAND)


def forkserver_preload() -> list[str]:
    """The modules the next fork server is to import (``set_forkserver_preload``'s, kept in ``_forkserver``)."""
    return list(multiprocessing.forkserver._forkserver._preload_modules)  # type: ignore[attr-defined]


def forget_forkserver() -> None:
    """In a just forked process: forget the parent's fork server (``_forkserver``); a new one starts on first use."""
    server: Any = multiprocessing.forkserver._forkserver
    _close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._lock = threading.Lock()  # another thread of the parent may have held it at the fork


def forget_resource_sharer() -> None:
    """In a just forked process: forget the parent's ``resource_sharer._resource_sharer``."""
    sharer: Any = getattr(multiprocessing.resource_sharer, "_resource_sharer")  # noqa: B009 (typeshed lacks it)
    if sharer._listener is not None:
        sharer._listener._listener._socket.close()  # this process's copy only
    for _, close in sharer._cache.values():
        close()
    sharer._cache = {}
    sharer._lock = threading.Lock()  # another thread of the parent may have held it at the fork
    sharer._listener = sharer._address = sharer._thread = None


def _close(fd: int | None) -> None:
    if fd is not None:
        with suppress(OSError):
            os.close(fd)


def stop_worker_servers(wait_s: float = 5.0) -> None:
    """SIGKILL and reap this process's fork server; close its resource tracker's pipe, reap it within ``wait_s``."""
    server: Any = multiprocessing.forkserver._forkserver
    with server._lock:
        pid, fd, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    _close(fd)
    if pid is not None:
        with suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if address is not None and not multiprocessing.util.is_abstract_socket_namespace(address):
        with suppress(OSError):
            os.unlink(address)
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        tracker._fd = tracker._pid = None
    _close(fd)
    deadline = time.monotonic() + wait_s
    with suppress(ChildProcessError):  # a forked process's copy of its parent's tracker
        while pid is not None and not os.waitpid(pid, os.WNOHANG)[0] and time.monotonic() < deadline:
            time.sleep(0.01)


def at_multiprocessing_exit(function: Callable[[], object]) -> None:
    """Call ``function()`` once at this process's normal exit, after multiprocessing's own exit work."""
    registry = multiprocessing.util._finalizer_registry  # type: ignore[attr-defined]
    if not any(f._callback is function and f._pid == os.getpid() for f in list(registry.values())):
        multiprocessing.util.Finalize(None, function, exitpriority=-100)


def raised_pickling_a_process(err: BaseException) -> bool:
    """Whether ``err`` came from multiprocessing pickling a process to start it (in ``reduction.py``'s ``dump``)."""
    codes = [frame.f_code for frame, _ in traceback.walk_tb(err.__traceback__)]
    reduction = os.path.join("multiprocessing", "reduction.py")
    return any(code.co_name == "dump" and code.co_filename.endswith(reduction) for code in codes)
