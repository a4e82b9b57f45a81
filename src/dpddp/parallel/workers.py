"""DataLoader workers that start from a fork server, end with their rank, and end the run in one line if stuck."""

from __future__ import annotations

import atexit
import builtins
import multiprocessing
import os
import sys
from collections.abc import Callable
from functools import partial
from types import FunctionType, ModuleType

from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader

import dpddp._compat as compat
from dpddp.errors import LoaderFailed, first_line
from dpddp.messages import dataloader_failure
from dpddp.parallel.launcher import die_with_parent

START_METHOD = "forkserver"  # a fork of a rank that runs threads can deadlock in the child
WORKER_TIMEOUT_S = 60.0  # seconds a rank waits for its workers' next batch, unless the loader has a timeout


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not), from ``/proc`` (dpddp runs on Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


class WorkerInitFailed(RuntimeError):
    """Raised in a DataLoader worker whose loader's own ``worker_init_fn`` raised (torch re-raises it in the rank)."""


class WorkerStart:
    """A loader's ``worker_init_fn``: die with the fork server, exit at once if the rank ``rank_pid`` is gone, then
    ``then(worker_id)``. Raises ``WorkerInitFailed`` when ``then`` raises. Picklable."""

    def __init__(self, rank_pid: int, then: Callable[[int], None] | None = None) -> None:
        self.rank_pid, self.then = rank_pid, then

    def __call__(self, worker_id: int) -> None:
        die_with_parent()
        compat.forget_forkserver()  # the rank's keep-alive pipe, sent here, would keep the server (and this) alive
        if not _alive(self.rank_pid):  # the rank died before the signal was armed: nothing would send it
            os._exit(1)
        if self.then is not None:
            try:
                self.then(worker_id)
            except Exception as err:
                name = getattr(self.then, "__qualname__", type(self.then).__qualname__)
                raise WorkerInitFailed(f"its worker_init_fn {name} raised {first_line(err)}") from err


if compat.in_fork_server():  # it preloads this module: exit at once, without finalizing what it imported
    atexit.register(os._exit, 0)  # the last registered runs first


def _preload(loader: DataLoader) -> None:
    """Add torch, this module and the loader's and main module's modules to the fork server's preload."""
    main = vars(sys.modules["__main__"]).values() if "__main__" in sys.modules else ()
    imported = [v for v in main if isinstance(v, (ModuleType, type, FunctionType)) and v is not builtins]
    inner = getattr(loader.dataset, "dataset", None)  # a wrapper's (a Subset's, dpddp's keyed samples)
    objects = [loader.dataset, inner, loader.collate_fn, *imported]
    names = {o.__name__ if isinstance(o, ModuleType) else getattr(o, "__module__", None) for o in objects}
    names |= {getattr(type(o), "__module__", None) for o in objects if not isinstance(o, (ModuleType, type))}
    found = {n for n in names if isinstance(n, str) and n not in ("__main__", "__mp_main__", "builtins")}
    found |= {"torch", __name__}
    preloaded = set(compat.forkserver_preload()) - {"__main__"}
    if not found <= preloaded:
        multiprocessing.set_forkserver_preload(sorted(preloaded | found))


def start_workers_safely(loader: object, rank: int) -> object:
    """``loader``, changed in place when it is a ``DataLoader`` with workers: ``START_METHOD``, ``WORKER_TIMEOUT_S``
    unless it has a timeout, a ``WorkerStart`` around its ``worker_init_fn`` (or Lightning's seeding of ``rank``)."""
    if not isinstance(loader, DataLoader) or not loader.num_workers or isinstance(loader.worker_init_fn, WorkerStart):
        return loader
    if loader.multiprocessing_context is None and START_METHOD in multiprocessing.get_all_start_methods():
        loader.multiprocessing_context = START_METHOD
        _preload(loader)
    compat.at_multiprocessing_exit(compat.stop_worker_servers)  # this process stops and reaps its server and tracker
    then = loader.worker_init_fn
    if then is None and int(os.environ.get("PL_SEED_WORKERS", 0)):
        then = partial(pl_worker_init_function, rank=rank)
    loader.worker_init_fn = WorkerStart(os.getpid(), then)
    if not loader.timeout:
        loader.timeout = WORKER_TIMEOUT_S
    return loader


def loader_failed(err: BaseException, rank: int) -> LoaderFailed | None:
    """The one-line ``LoaderFailed`` for a DataLoader worker that could not start or is stuck or dead; else ``None``."""
    start = f"rank {rank}: a DataLoader worker could not start (data.num_workers > 0)"
    if isinstance(err, WorkerInitFailed):
        said = str(err).rstrip().splitlines()[-1].split(f"{WorkerInitFailed.__name__}: ", 1)[-1]
        fix = "fix it (it runs first in each worker process), or set data.num_workers=0 to load in the rank"
        return LoaderFailed(f"{start}: {said}; {fix}")
    if compat.raised_pickling_a_process(err):
        how = "its workers start from a fork server, which gets the data set, sampler, collate_fn and worker_init_fn"
        fix = "define them at a module's top level, without lambdas, local classes, open files or generators"
        said = f"the DataLoader cannot be pickled ({first_line(err)})"
        return LoaderFailed(f"{start}: {said}: {how} pickled; {fix}, or set data.num_workers=0")
    what = dataloader_failure((str(err).splitlines() or [""])[0]) if isinstance(err, RuntimeError) else None
    if what is None:
        return None
    why = "its data set's __getitem__ or the collate_fn hangs or crashed in a worker process"
    own = "give the DataLoader a timeout=SECONDS of its own if a batch takes longer"
    fix = f"set data.num_workers=0 to load in the rank and see where, or {own}"
    return LoaderFailed(f"rank {rank}: {what} (data.num_workers > 0): {why}; {fix}")
