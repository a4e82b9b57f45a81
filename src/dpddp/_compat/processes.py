"""CPython multiprocessing's private names (DataLoader workers' helpers), checked in ``CHECKED``; tests/test_compat.py
fails when one moves (docs/design-notes.md, parallel.workers)."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_sharer
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

CHECKED = "3.11.7"
"""The CPython version every entry below was read in and tested against."""

FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"
"""How ``ForkServer.ensure_running``'s command (``python -c``) begins."""


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server or a worker it forked."""
    return sys.orig_argv[-2:-1] == ["-c"] and sys.orig_argv[-1].startswith(FORK_SERVER_COMMAND)


def forkserver_preload() -> list[str]:
    """The modules the next fork server is to import (``set_forkserver_preload``'s, kept in ``_forkserver``)."""
    return list(multiprocessing.forkserver._forkserver._preload_modules)  # type: ignore[attr-defined]


def forget_forkserver() -> None:
    """In a just forked process: forget the parent's fork server (``forkserver._forkserver``); a new one starts on
    first use."""
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
    """SIGKILL and reap the fork server this process started (its own ``_stop`` waits seconds), close its end of
    the resource tracker's pipe and reap the tracker within ``wait_s``; each starts again on next use."""
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
    """Call ``function()`` at this process's normal exit, after multiprocessing's own exit work (``util.Finalize``
    with the lowest ``exitpriority``); registered once per process however often it is asked."""
    registry = multiprocessing.util._finalizer_registry  # type: ignore[attr-defined]
    mine = [f for f in list(registry.values()) if f._callback is function and f._pid == os.getpid()]
    if not mine:
        multiprocessing.util.Finalize(None, function, exitpriority=-100)


def raised_pickling_a_process(err: BaseException) -> bool:
    """Whether ``err`` was raised while multiprocessing pickled a process to start it (its traceback runs through
    ``multiprocessing/reduction.py``'s ``dump``)."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "dump" and code.co_filename.endswith(os.path.join("multiprocessing", "reduction.py")):
            return True
        tb = tb.tb_next
    return False
