"""Every private Lightning, torch and Hydra name and behaviour dpddp relies on, and only here.

Each entry says the version it was checked against (``CHECKED``), and what breaks if it moves. ``tests/test_compat.py``
fails when one moves, so an upgrade of Lightning, torch or Hydra is a failing test, not a silent change of behaviour
(the worst one: Lightning's own DDP launcher coming back, which replays Hydra sweeps in every rank).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
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

# The base of the project's DDP launcher. Lightning's `_call_and_handle_interrupt` kills the children of a
# launcher of this type on Ctrl-C (isinstance check), so JobLauncher subclasses it.
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

__all__ = [
    "AGENT_STORE_ENV",
    "CHECKED",
    "HOOK_NAME_ATTRIBUTE",
    "Launcher",
    "SubprocessScriptLauncher",
    "agent_store",
    "disable_sigterm_broadcast",
    "hydra_mode_unset",
    "data_position",
    "epoch_finished_in",
    "fit_restarting",
    "init_process_group",
    "keep_unfinished_epoch",
    "logged_metric_kinds",
    "processed_epochs",
    "rank0_store",
    "resolve_process_group_backend",
    "restore_sigterm_broadcast",
    "set_num_threads_if_needed",
    "skip_empty_batch_hooks",
    "uncount_last_batch",
    "counted_step",
]

CHECKED = {"lightning": "2.6.6", "torch": "2.13.0", "hydra-core": "1.3.8"}
"""The versions every entry below was read in and tested against."""

SubprocessScriptLauncher = _SubprocessScriptLauncher
Launcher = _Launcher
"""The base class of Lightning's launchers (the type of ``Strategy.launcher``); for annotations only."""

HOOK_NAME_ATTRIBUTE = "_current_fx_name"
"""``LightningModule._current_fx_name``: Lightning sets it around every hook call (~20 per training step). The
built-in models set it with a plain ``object.__setattr__`` (``nn.Module.__setattr__`` costs microseconds each).
If renamed: only that speed-up is lost."""


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's intra-op thread count for ``num_processes`` processes per node (cores / processes unless
    ``OMP_NUM_THREADS`` is set), as its own launchers set it. If renamed: import fails."""
    _set_num_threads_if_needed(num_processes=num_processes)


def resolve_process_group_backend(strategy: pl.strategies.DDPStrategy) -> str:
    """Lightning's ``DDPStrategy._get_process_group_backend()`` (the configured backend, else gloo on CPU and
    nccl on CUDA), stored in ``strategy._process_group_backend`` as Lightning's ``setup_distributed`` does (its
    public ``process_group_backend`` property reads it)."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    return strategy._process_group_backend


def init_process_group(
    env: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device, store: Any = None
) -> None:
    """Lightning's ``_init_dist_connection`` with Lightning's own guard around ``device_id`` (torch >= 2.3:
    binds the process group to the rank's GPU; ``None`` on CPU) and an optional ``store``.

    Source: ``lightning.pytorch.strategies.DDPStrategy.setup_distributed`` (2.6.6)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if store is not None:
        kwargs["store"] = store
    if _TORCH_GREATER_EQUAL_2_3:
        kwargs["device_id"] = device if device.type != "cpu" else None
    _init_dist_connection(env, backend, **kwargs)


def rank0_store(sock: socket.socket, world_size: int, timeout: timedelta) -> torch.distributed.Store:
    """Rank 0's rendezvous store on an already bound, listening ``sock`` (so it listens only where the launcher
    bound it, and the port was held from before the other ranks started).

    Two torch behaviours, both checked on torch 2.13: ``TCPStore(master_listen_fd=...)`` takes over a listening
    socket, and only the non-libuv store accepts one (``use_libuv=False``); and the other ranks, which rendezvous
    through ``env://``, see the store under ``PrefixStore("default_pg", ...)`` while a store passed to
    ``init_process_group`` is used as it is, so it is wrapped alike for the keys to meet. If either changes, the
    ranks of a single-node ddp run cannot meet: ``test_runs`` fails.
    """
    address, port = sock.getsockname()[:2]
    store = torch.distributed.TCPStore(
        address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=False,
    )  # fmt: skip
    return torch.distributed.PrefixStore("default_pg", store)


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to ``"True"`` by torchrun's agent (``LocalElasticAgent._start_workers``) in every worker when
``MASTER_ADDR``:``MASTER_PORT`` is the agent's own store (the default: static rendezvous, and c10d unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""


def agent_store(address: str, port: int, timeout: timedelta) -> torch.distributed.Store | None:
    """A client of torchrun's agent store when this worker was handed one (``AGENT_STORE_ENV``), else ``None``.

    The behaviour this works around, checked on torch 2.13: the agent keeps that store across
    ``--max-restarts`` (the static handler creates it once; the c10d handler caches ``_shared_tcp_store_server``
    after its first round), while ``torch.distributed.rendezvous._create_c10d_store`` hands the workers a plain
    client, without a per-attempt prefix ("we create a new TCPStore for every retry", it says). Restarted
    workers then read the failed attempt's keys (pytorch/pytorch#135712 for NCCL; for gloo, a dead pair address
    retried until the timeout). ``dpddp.parallel.rendezvous.join_start`` gives each start a prefix of its own.
    If torch starts prefixing per attempt itself, this stays correct (a prefix inside a fresh store).
    """
    if os.environ.get(AGENT_STORE_ENV) != str(True):
        return None
    return torch.distributed.TCPStore(address, port, is_master=False, timeout=timeout)


def disable_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Turn off ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (Lightning >= 2.5) for this fit: a blocking
    collective before every training step that broadcasts rank 0's SIGTERM flag. ``Preemption`` replaces
    Lightning's SIGTERM handler, so that flag can no longer be set. If renamed: the per-step collective comes
    back (~0.9 ms a step under ddp on 2 cores), nothing else; test_compat fails."""
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        raise RuntimeError("lightning moved _TrainingEpochLoop._broadcast_sigterm_tensor: update dpddp._compat")
    loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]


def restore_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Undo ``disable_sigterm_broadcast``."""
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def data_position(trainer: pl.Trainer) -> tuple[int, int]:
    """Where the training data stream stands: ``(epoch, batches of it already trained)``, from the batches the
    fit has completed in all (``fit_loop.epoch_loop.batch_progress.total.completed``, restored from checkpoints)
    and the batches per epoch (``trainer.num_training_batches``, limits applied).

    The one source of the global-batch sampler's order, read when an epoch's iteration starts: it cannot
    disagree with the trained weights, whatever Lightning's epoch counters say after a stop by a limit, a
    restart on an epoch's last batch, or a SIGTERM (Lightning counts the batch a checkpoint was saved in as
    completed when it restores). Checked on Lightning 2.6.6; test_compat and the resume tests fail if it moves.
    """
    per_epoch = trainer.num_training_batches
    if not per_epoch or per_epoch == float("inf"):
        return trainer.current_epoch, 0
    done = trainer.fit_loop.epoch_loop.batch_progress.total.completed
    epoch, skip = divmod(int(done), int(per_epoch))
    return epoch, skip


def keep_unfinished_epoch(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Record an epoch that fit left before its last batch (a stop by ``max_steps``, ``max_time``, EarlyStopping
    mid-epoch...) as unfinished in ``checkpoint``, as a checkpoint taken inside the epoch records it.

    Lightning counts the epoch as processed when the fit loop ends, whatever ended it
    (``checkpoint["loops"]["fit_loop"]["epoch_progress"]``: ``processed`` ahead of ``completed``), so a run
    continued from it would start the next epoch and never train the rest of this one; once the fit
    has ended it counts it as completed too. With both set back to the epochs before it, Lightning restores
    mid-epoch (``FitLoop.restarting``) and the global-batch sampler skips the batches already trained: the
    continued run follows a straight run's order.
    Checked on Lightning 2.6.6; if the layout moves, ``tests/test_compat.py`` and the limit-resume tests fail.
    """
    if trainer.fit_loop.epoch_loop.batch_progress.current.processed >= trainer.num_training_batches:  # type: ignore[attr-defined]
        return
    _unfinish_epoch(checkpoint)


def _unfinish_epoch(checkpoint: dict[str, Any]) -> None:
    progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for part in ("total", "current"):  # the epoch started (ready, started) and is neither processed nor completed
        progress[part]["processed"] = progress[part]["completed"] = progress[part]["started"] - 1


def uncount_last_batch(checkpoint: dict[str, Any]) -> None:
    """Count the fit's last training batch (one Lightning loop iteration) in ``checkpoint`` as not done, and its
    epoch as unfinished: for an execution of several steps that ``max_steps`` cut short
    (``dpddp.run.executions``). A continued run then restores before it, and the sampler yields its rest first.

    Edits ``checkpoint["loops"]["fit_loop"]``: ``"epoch_loop.batch_progress"`` (``total`` and ``current``:
    ``ready``, ``started``, ``processed``, ``completed``, each one less) and ``"epoch_progress"`` (as
    ``keep_unfinished_epoch``). Checked on Lightning 2.6.6; test_compat and the steps-per-execution resume tests
    fail if it moves."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for part in ("total", "current"):
        for key in ("ready", "started", "processed", "completed"):
            progress[part][key] -= 1
    progress["is_last_batch"] = False
    _unfinish_epoch(checkpoint)


def counted_step(optimizer: Any) -> None:
    """The optimizer step of ``LightningOptimizer.step`` without its strategy and precision wrappers (their
    ``on_before_optimizer_step`` hooks and closure; callers check that nothing overrides them and the precision
    is plain 32-bit): ``_on_before_step``, the raw optimizer's ``step``, ``_on_after_step``. Those two are set by
    the manual-optimization loop (``_ManualOptimization.on_run_start``) and count the step in
    ``trainer.global_step``. Checked on Lightning 2.6.6: if they move, ``global_step`` stops counting and the
    steps-per-execution tests fail (test_compat names them)."""
    optimizer._on_before_step()
    optimizer.optimizer.step()
    optimizer._on_after_step()


def epoch_finished_in(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` (being written, its loops already in) records the fit's current epoch as having
    trained all its batches (``"epoch_loop.batch_progress"`` ``current.processed``, as ``keep_unfinished_epoch``
    reads it live, after ``uncount_last_batch``): a continued run then starts the next epoch. Checked on
    Lightning 2.6.6."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    return bool(progress["current"]["processed"] >= trainer.num_training_batches)


def processed_epochs(checkpoint: dict[str, Any]) -> int | None:
    """Epochs a checkpoint's fit loop has processed (``["loops"]["fit_loop"]["epoch_progress"]["current"]
    ["processed"]``), ``None`` when it records none. Checked on Lightning 2.6.6; test_compat fails if it moves."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    done = loop.get("epoch_progress", {}).get("current", {}).get("processed")
    return done if isinstance(done, int) else None


def fit_restarting(trainer: pl.Trainer) -> bool:
    """Whether the fit loop was restored inside an epoch (``trainer.fit_loop.restarting``, set while a restored
    loop has not yet run past its checkpoint). Checked on Lightning 2.6.6; test_compat fails if it moves."""
    return bool(trainer.fit_loop.restarting)


def logged_metric_kinds(trainer: pl.Trainer) -> dict[str, tuple[bool, bool]]:
    """What the module logged in the running loop: ``{name: (a torchmetrics Metric object, sync_dist)}``, read
    from ``trainer._results`` (a ``_ResultCollection`` of ``_ResultMetric`` with ``is_tensor`` and
    ``meta.name``, ``meta.sync.should``); ``{}`` outside a loop. Checked on Lightning 2.6.6; if moved, only the
    metric-contract warning goes quiet (test_compat fails)."""
    results = trainer._results
    found: dict[str, tuple[bool, bool]] = {}
    for value in (results or {}).values():
        meta = getattr(value, "meta", None)
        if meta is not None:
            found[meta.name] = (not value.is_tensor, bool(meta.sync.should))
    return found


PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
"""The callback hooks Lightning calls for every batch, all through ``trainer.call._call_callback_hooks`` (checked on
Lightning 2.6.6: no other caller)."""


def skip_empty_batch_hooks(callbacks: Iterable[pl.Callback]) -> None:
    """Set to ``None``, on each callback object, every hook of ``PER_BATCH_HOOKS`` that its class does not override
    (``pl.Callback``'s empty one), so that Lightning skips it.

    ``_call_callback_hooks`` calls each hook of every callback for every batch, empty ones included, each call in a
    profiler context named after the callback's ``state_key`` (2-15 µs a call on 2 busy cores, the most for a
    ``ModelCheckpoint``, whose key is a ``repr`` of its settings; a default run's seven callbacks made ~40 such calls
    a training step), and it skips an attribute that is not ``callable``; Lightning's ``is_overridden`` reads ``None``
    as not overridden. Checked on Lightning 2.6.6: if the ``callable`` check goes, calling ``None`` raises
    ``TypeError`` at the first batch (test_compat fails)."""
    for callback in callbacks:
        for name in PER_BATCH_HOOKS:
            if getattr(type(callback), name, None) is getattr(pl.Callback, name):
                callback.__dict__[name] = None


@contextmanager
def hydra_mode_unset() -> Iterator[None]:
    """Inside the block, Hydra's ``Hydra.get_mode`` answers ``None`` at once: what it answers for a config that sets
    no ``hydra.mode`` (or that does not compose). ``hydra.main`` (``_run_hydra``) composes the whole config once
    only for that answer, then again to run: one composition of two, ~0.1 s of every run's start-up (bench/). For
    callers that know the config sets no mode. Checked on hydra-core 1.3.8; test_compat fails if ``_run_hydra``
    stops asking ``get_mode`` or ``get_mode`` stops reading ``hydra.mode`` from a composition."""
    from hydra._internal.hydra import Hydra

    get_mode = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = get_mode  # type: ignore[method-assign]


BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
"""torch's base class of ``BatchNorm1d/2d/3d``, ``SyncBatchNorm`` and the lazy ones (torch 2.13): what
``dpddp.parallel.batchnorm`` converts and the base of its ``GlobalBatchNorm`` (the same parameters, buffers,
``state_dict`` keys and versioned loading). If renamed: importing ``dpddp.parallel.batchnorm`` fails."""


HYDRA_BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
"""The ``_target_`` of Hydra's default launcher (``hydra/launcher=basic``), a private module path (hydra-core
1.3.8). ``dpddp.entry.summary.LOCAL_LAUNCHERS`` names it: if it moves, a SIGTERM no longer stops a basic sweep as
one (test_compat fails)."""
