"""Every private Lightning, torch and Hydra name and behaviour dpddp relies on; CPython's are in ``processes``.

Each entry names what it relies on, the version checked (``CHECKED``) and what breaks if it moves;
``tests/test_compat.py`` fails when one moves. See docs/design-notes.md (_compat).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment

# Lightning >= 2.2: used by Lightning's DDPStrategy.setup_distributed, which DDPStrategy.setup_distributed copies
# for rank 0's own store. If renamed: `import dpddp.parallel.ddp` fails (test_compat names it).
from lightning.fabric.utilities.distributed import _init_dist_connection, _set_num_threads_if_needed

# Lightning's guard of the `device_id` argument of init_process_group (torch >= 2.3); the copied code keeps it.
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3

# JobLauncher's base: Lightning's `_call_and_handle_interrupt` kills the children of this type of launcher on Ctrl-C.
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage

__all__ = ["AGENT_STORE_ENV", "CHECKED", "HOOK_NAME_ATTRIBUTE", "Launcher", "SubprocessScriptLauncher", "agent_store"]
__all__ += ["disable_sigterm_broadcast", "hydra_command_line", "hydra_mode_unset", "data_position"]
__all__ += ["epoch_finished_in", "float_batch_counts", "init_process_group", "hydra_override_refused"]
__all__ += ["keep_unfinished_epoch", "logged_metric_kinds", "logged_tensor_states", "processed_epochs", "rank0_store"]
__all__ += ["resolve_process_group_backend", "restore_logged_tensors", "restore_sigterm_broadcast", "counted_step"]
__all__ += ["agent_store_shared", "epoch_cut", "restart_train_iterator", "skip_next_validation"]
__all__ += ["set_num_threads_if_needed", "skip_empty_batch_hooks", "softmax_per_sample", "uncount_last_batch"]
__all__ += ["batches_counted_as_steps", "count_logged_step", "step_count_either_way"]

CHECKED = {"lightning": "2.6.6", "torch": "2.13.0", "hydra-core": "1.3.8"}
"""The versions every entry below was read in and tested against."""

SubprocessScriptLauncher = _SubprocessScriptLauncher
Launcher = _Launcher
"""The base class of Lightning's launchers (the type of ``Strategy.launcher``); for annotations only."""

HOOK_NAME_ATTRIBUTE = "_current_fx_name"
"""``LightningModule._current_fx_name``, set around every hook call; the built-in models set it with
``object.__setattr__``. Lightning 2.6.6. If renamed: only that speed-up is lost."""


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's ``_set_num_threads_if_needed``: cores / ``num_processes`` threads unless ``OMP_NUM_THREADS``
    is set. Lightning 2.6.6. If renamed: import fails."""
    _set_num_threads_if_needed(num_processes=num_processes)


def resolve_process_group_backend(strategy: pl.strategies.DDPStrategy) -> str:
    """``DDPStrategy._get_process_group_backend()`` (configured, else gloo on CPU, nccl on CUDA), stored in
    ``strategy._process_group_backend`` as ``setup_distributed`` does. Lightning 2.6.6. If renamed: ddp setup fails."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    return strategy._process_group_backend


def init_process_group(
    env: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device, store: Any = None
) -> None:
    """Lightning's ``_init_dist_connection`` with its ``device_id`` guard (torch >= 2.3; ``None`` on CPU) and an
    optional ``store``. Source: ``lightning.pytorch.strategies.DDPStrategy.setup_distributed`` (2.6.6)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if store is not None:
        kwargs["store"] = store
    if _TORCH_GREATER_EQUAL_2_3:
        kwargs["device_id"] = device if device.type != "cpu" else None
    _init_dist_connection(env, backend, **kwargs)


def rank0_store(sock: socket.socket, world_size: int, timeout: timedelta) -> torch.distributed.Store:
    """Rank 0's rendezvous store on the bound, listening ``sock``, under ``PrefixStore("default_pg", ...)``: relies
    on ``TCPStore(master_listen_fd=..., use_libuv=False)`` and that prefix of ``env://`` ranks (torch 2.13; design
    notes). If either changes, single-node ddp ranks cannot meet (``test_runs``)."""
    address, port = sock.getsockname()[:2]
    store = torch.distributed.TCPStore(
        address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=False,
    )  # fmt: skip
    return torch.distributed.PrefixStore("default_pg", store)


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to ``"True"`` by torchrun's ``LocalElasticAgent._start_workers`` when ``MASTER_ADDR:MASTER_PORT`` is the
agent's own store (torch 2.13)."""


def agent_store_shared() -> bool:
    """Whether torchrun handed this worker its agent's own store as ``MASTER_ADDR:MASTER_PORT``
    (``AGENT_STORE_ENV``)."""
    return os.environ.get(AGENT_STORE_ENV) == str(True)


def agent_store(address: str, port: int, timeout: timedelta) -> torch.distributed.Store | None:
    """A client of torchrun's agent store when this worker was handed one (``AGENT_STORE_ENV``), else ``None``;
    the agent keeps it across ``--max-restarts`` with no per-attempt prefix (torch 2.13; design notes, _compat)."""
    if not agent_store_shared():
        return None
    return torch.distributed.TCPStore(address, port, is_master=False, timeout=timeout)


def disable_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Turn off Lightning's SIGTERM collectives for one Trainer (2.6.6; docs/design-notes.md, continuity.stop):
    ``_TrainingEpochLoop._broadcast_sigterm_tensor`` and ``_SignalConnector._sigterm_notifier_fn`` (on a rank
    other than 0 it waits for the group's timeout). Raises ``RuntimeError`` if one moved; test_compat."""
    loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
    for owner, name in ((loop, "_broadcast_sigterm_tensor"), (connector, "_sigterm_notifier_fn")):
        if not callable(getattr(type(owner), name, None)):
            raise RuntimeError(f"lightning moved {type(owner).__name__}.{name}: update dpddp._compat")
    loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]
    connector._sigterm_notifier_fn = lambda signum, _: None  # type: ignore[method-assign]


def restore_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Undo ``disable_sigterm_broadcast``'s per-step broadcast (the notifier stays quiet)."""
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def data_position(trainer: pl.Trainer, length: int | None = None) -> tuple[int, int]:
    """``(epoch, batches of it trained)`` from ``fit_loop.epoch_loop.batch_progress.total`` (``processed`` counts: a
    save in ``on_train_batch_end``) and ``num_training_batches``, or, before Lightning counts them, ``length`` cut as
    ``_parse_num_batches`` does (docs/design-notes.md). Lightning 2.6.6; test_compat fails if it moves."""
    per_epoch = trainer.num_training_batches
    if per_epoch == float("inf") and length:
        per_epoch = _parse_num_batches(RunningStage.TRAINING, length, trainer.limit_train_batches)
    if not per_epoch or per_epoch == float("inf"):
        return trainer.current_epoch, 0
    total = trainer.fit_loop.epoch_loop.batch_progress.total
    done = max(total.completed, getattr(total, "processed", 0))  # a _ProcessedTracker, typed as its base
    return divmod(int(done), int(per_epoch))


def keep_unfinished_epoch(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Mark an epoch that fit left before its last batch as unfinished in ``checkpoint``
    (``["loops"]["fit_loop"]["epoch_progress"]`` ``processed``/``completed``), so a continued run restores
    mid-epoch (docs/design-notes.md). Lightning 2.6.6; test_compat and the limit-resume tests fail if it moves."""
    if epoch_cut(trainer):
        _unfinish_epoch(checkpoint)


def epoch_cut(trainer: pl.Trainer) -> bool:
    """Whether fit is leaving (or left) the current epoch before its last batch: a limit, or a stop, cut it
    (``fit_loop.epoch_loop.batch_progress.current.processed``). Lightning 2.6.6; test_compat fails if it moves."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
    return bool(done < trainer.num_training_batches)


def _unfinish_epoch(checkpoint: dict[str, Any]) -> None:
    progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for part in ("total", "current"):  # the epoch started (ready, started) and is neither processed nor completed
        progress[part]["processed"] = progress[part]["completed"] = progress[part]["started"] - 1


def uncount_last_batch(checkpoint: dict[str, Any]) -> None:
    """Count the fit's last loop iteration in ``checkpoint`` as not done and its epoch as unfinished (an execution
    ``max_steps`` cut short): ``["loops"]["fit_loop"]["epoch_loop.batch_progress"]`` counters each one less.
    Lightning 2.6.6; test_compat and the steps-per-execution resume tests fail if it moves."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for part in ("total", "current"):
        for key in ("ready", "started", "processed", "completed"):
            progress[part][key] -= 1
    progress["is_last_batch"] = False
    _unfinish_epoch(checkpoint)


def step_count_either_way(checkpoint: dict[str, Any]) -> None:
    """Set both optimizer-step counters of ``checkpoint``'s fit loop to its ``global_step``: automatic
    optimization's (``epoch_loop.automatic_optimization.optim_progress``) and manual's (``epoch_loop.manual_
    optimization.optim_step_progress``), ``total`` ``ready`` and ``completed``; ``trainer.global_step`` reads the one
    of the module's mode, and a fit saved in the other mode (``data.micro_batch_size`` or ``steps_per_execution``
    added or removed) would restart it. Lightning 2.6.6; test_compat fails if they move."""
    loops, step = checkpoint.get("loops", {}).get("fit_loop"), checkpoint.get("global_step")
    if not loops or not isinstance(step, int):
        return
    automatic = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    manual = loops["epoch_loop.manual_optimization.optim_step_progress"]["total"]
    for total in (automatic, manual):
        total["ready"] = total["completed"] = step


def batches_counted_as_steps(checkpoint: dict[str, Any]) -> None:
    """Set ``checkpoint``'s fit-loop ``epoch_loop.batch_progress`` ``total`` counters to its ``global_step``: the
    loop iterations of a fit without executions (one global batch each), which ``data_position`` reads; for a
    checkpoint written at an epoch's end with ``steps_per_execution`` above 1 (iterations are executions there)
    continued with 1. Lightning 2.6.6; test_compat fails if it moves."""
    total = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    for key in total:
        total[key] = int(checkpoint["global_step"])


def counted_step(optimizer: Any) -> None:
    """``LightningOptimizer.step`` without strategy and precision wrappers: ``_on_before_step``, the raw
    ``step``, ``_on_after_step`` (which count ``trainer.global_step``). Lightning 2.6.6; if they move,
    ``global_step`` stops counting (test_compat)."""
    optimizer._on_before_step()
    optimizer.optimizer.step()
    optimizer._on_after_step()


def epoch_finished_in(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` records the current epoch as fully trained (``"epoch_loop.batch_progress"``
    ``current.processed``). Lightning 2.6.6; test_compat fails if it moves."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    return bool(progress["current"]["processed"] >= trainer.num_training_batches)


def processed_epochs(checkpoint: dict[str, Any]) -> int | None:
    """``checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]``, else ``None``.
    Lightning 2.6.6; test_compat fails if it moves."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    done = loop.get("epoch_progress", {}).get("current", {}).get("processed")
    return done if isinstance(done, int) else None


def skip_next_validation(trainer: pl.Trainer) -> None:
    """Lightning's epoch loop skips the validation it would run after the current training batch
    (``fit_loop.epoch_loop._skip_next_val``). Lightning 2.6.6; raises ``RuntimeError`` if it moved (test_compat)."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_skip_next_val"):
        raise RuntimeError("lightning's fit_loop.epoch_loop._skip_next_val moved: dpddp._compat needs an update")
    loop._skip_next_val = True


def count_logged_step(trainer: pl.Trainer) -> None:
    """One more optimizer step on the loggers' step axis: ``fit_loop.epoch_loop._batches_that_stepped``, the step
    Lightning logs at and counts once a loop iteration, so that an execution's steps each count one. Lightning
    2.6.6; raises ``RuntimeError`` if it moved (test_compat)."""
    loop = trainer.fit_loop.epoch_loop
    if not isinstance(getattr(loop, "_batches_that_stepped", None), int):
        raise RuntimeError("lightning's fit_loop.epoch_loop._batches_that_stepped moved: dpddp._compat needs an update")
    loop._batches_that_stepped += 1


def restart_train_iterator(trainer: pl.Trainer) -> None:
    """At an epoch's ``on_train_epoch_start``: make the training loader's iterator again
    (``iter(trainer.fit_loop._data_fetcher)``) unless the epoch loop makes this epoch's itself
    (``_TrainingEpochLoop.on_run_start``: after epoch 0, neither resuming nor restarting). A ``DataLoader``
    iterator draws its base seed from the global stream; Lightning 2.6.6 makes a fit's first one in
    ``setup_data``, before any hook, and a fit resumed at an epoch's start makes no other for that epoch.
    Raises ``RuntimeError`` if it moved; test_compat."""
    loop = trainer.fit_loop
    if not hasattr(loop, "_data_fetcher"):
        raise RuntimeError("lightning moved _FitLoop._data_fetcher: update dpddp._compat")
    if trainer.current_epoch > 0 and not loop.is_resuming and not loop.epoch_loop.restarting:
        return  # the epoch loop makes it
    if loop._data_fetcher is not None:
        iter(loop._data_fetcher)


def logged_metric_kinds(trainer: pl.Trainer) -> dict[str, tuple[bool, bool]]:
    """``{name: (is a torchmetrics Metric, sync_dist)}`` logged in the running loop, from ``trainer._results``;
    ``{}`` outside a loop. Lightning 2.6.6; if moved, only the metric-contract warning goes quiet."""
    results = trainer._results
    found: dict[str, tuple[bool, bool]] = {}
    for value in (results or {}).values():
        meta = getattr(value, "meta", None)
        if meta is not None:
            found[meta.name] = (not value.is_tensor, bool(meta.sync.should))
    return found


def logged_tensor_states(trainer: pl.Trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``{key: (accumulated value, accumulated batch size or None)}`` of the plain tensors logged in the running
    loop so far, from ``trainer._results`` (Lightning 2.6.6's ``_ResultMetric`` states ``value`` and
    ``cumulated_batch_size``), for ``restore_logged_tensors``."""
    found: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for key, value in (trainer._results or {}).items():
        if getattr(value, "is_tensor", False):
            count = getattr(value, "cumulated_batch_size", None)
            found[key] = (value.value.clone(), count.clone() if count is not None else None)
    return found


def restore_logged_tensors(trainer: pl.Trainer, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Put the logged plain tensors back to ``states`` (``logged_tensor_states``); one first logged since then
    goes back to holding nothing: 0 (a mean's or sum's), or -inf/inf (a max's/min's), over 0 samples."""
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
    """Make the accumulated batch sizes of the plain tensors logged in the running loop float64
    (``_ResultMetric.cumulated_batch_size``, int64) before the epoch's ``compute``, so that their ``sync_dist``
    mean over ranks is not floored (Lightning 2.6.6 ``_sync_ddp``; design notes, _compat)."""
    for value in (trainer._results or {}).values():
        count = getattr(value, "cumulated_batch_size", None)
        if getattr(value, "is_tensor", False) and count is not None and not torch.is_floating_point(count):
            value.cumulated_batch_size = count.to(torch.float64)


TORCHMETRICS_SOFTMAX_MODULES = (
    "torchmetrics.functional.classification.precision_recall_curve",  # AUROC, AveragePrecision, ROC, ...
    "torchmetrics.functional.classification.calibration_error",
    "torchmetrics.functional.classification.hinge",
)
"""The torchmetrics 1.9 modules whose multiclass formats call ``normalize_logits_if_needed(preds, "softmax")``."""


def _softmax_per_sample(tensor: torch.Tensor, normalization: Any, original: Any) -> torch.Tensor:
    if normalization != "softmax" or tensor.dim() < 2:
        return original(tensor, normalization)
    in_range = ((tensor >= 0) & (tensor <= 1)).all(dim=1, keepdim=True)
    sums_to_one = (tensor.sum(dim=1, keepdim=True) - 1).abs() <= 1e-4
    return torch.where(in_range & sums_to_one, tensor, tensor.softmax(dim=1))


def softmax_per_sample() -> None:
    """Make torchmetrics 1.9's multiclass metrics that take logits or probabilities decide it for each sample (in
    [0, 1] summing to 1 within 1e-4: probabilities), not each update (design notes, _compat): replaces
    ``normalize_logits_if_needed`` in ``TORCHMETRICS_SOFTMAX_MODULES`` (its sigmoid uses kept); idempotent."""
    import importlib
    from functools import partial

    for name in TORCHMETRICS_SOFTMAX_MODULES:
        module = importlib.import_module(name)
        current = module.normalize_logits_if_needed
        if not isinstance(current, partial):
            module.normalize_logits_if_needed = partial(_softmax_per_sample, original=current)  # type: ignore[attr-defined]


PER_BATCH_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip
"""The callback hooks Lightning calls for every batch, only through ``trainer.call._call_callback_hooks`` (2.6.6)."""


def skip_empty_batch_hooks(callbacks: Iterable[pl.Callback]) -> None:
    """Set to ``None`` on each callback every ``PER_BATCH_HOOKS`` hook its class does not override, so that
    ``_call_callback_hooks`` (which skips non-callables) skips it. Lightning 2.6.6; if that check goes, the first
    batch raises ``TypeError`` (test_compat)."""
    for callback in callbacks:
        for name in PER_BATCH_HOOKS:
            if getattr(type(callback), name, None) is getattr(pl.Callback, name):
                callback.__dict__[name] = None


def hydra_command_line(argv: list[str]) -> argparse.Namespace | None:
    """``argv`` as ``hydra.main`` reads it, by Hydra's own parser (``hydra._internal.utils.get_args_parser``,
    hydra-core 1.3.8: ``run``, ``multirun``, ``cfg``, ``info``, ``shell_completion``, ``resolve``, ``help``...);
    ``None`` where the parser refuses it or would act on it (``--version`` prints and exits): Hydra then answers."""
    from hydra._internal.utils import get_args_parser

    if "--version" in argv:
        return None
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        return parser.parse_known_args(argv)[0]
    except argparse.ArgumentError:
        return None


@contextmanager
def hydra_mode_unset() -> Iterator[None]:
    """Inside the block ``hydra._internal.hydra.Hydra.get_mode`` returns ``None`` without composing, for callers
    whose config sets no ``hydra.mode``. hydra-core 1.3.8; test_compat fails if ``_run_hydra`` stops using it."""
    from hydra._internal.hydra import Hydra

    get_mode = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = get_mode  # type: ignore[method-assign]


@contextmanager
def hydra_override_refused(refused: Callable[[Any, Any, Exception], None]) -> Iterator[None]:
    """Hydra's ``ConfigLoaderImpl._apply_overrides_to_config`` (1.3.8) calls ``refused(override, cfg, err)`` first."""
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

    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(one_at_a_time)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._apply_overrides_to_config = apply  # type: ignore[method-assign]


BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
"""``torch.nn.modules.batchnorm._BatchNorm``, base of every BatchNorm and of ``GlobalBatchNorm`` (torch 2.13).
If renamed: importing ``dpddp.parallel.batchnorm`` fails."""


HYDRA_BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
"""The private ``_target_`` of Hydra's basic launcher (hydra-core 1.3.8), in ``dpddp.entry.summary.LOCAL_LAUNCHERS``.
If it moves, a SIGTERM no longer stops a basic sweep as one (test_compat fails)."""
