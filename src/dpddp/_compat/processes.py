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
from typing import Any

CHECKED = "3.11.7"
"""The CPython version every entry below was read in and tested against."""

FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"
"""How CPython 3.11.7's ``ForkServer.ensure_running`` command (``python -c``) begins."""


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server or a worker it forked."""
    return sys.orig_argv[-2:-1] == ["-c"] and sys.orig_argv[-1].startswith(FORK_SERVER_COMMAND)


def forget_forkserver() -> None:
    """In a just forked process: forget the parent's fork server (CPython 3.11.7's ``forkserver._forkserver``
    fields, reset in place); a new one starts on first use."""
    server: Any = multiprocessing.forkserver._forkserver
    _close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._lock = threading.Lock()  # another thread of the parent may have held it at the fork


def forget_resource_sharer() -> None:
    """In a just forked process: forget the parent's ``resource_sharer._resource_sharer`` (CPython 3.11.7)."""
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
        try:
            os.close(fd)
        except OSError:
            pass


def _stop_forkserver() -> None:
    """SIGKILL and reap this process's fork server, if it started one (its own ``_stop`` waits seconds)."""
    server: Any = multiprocessing.forkserver._forkserver
    with server._lock:
        pid, fd, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    _close(fd)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    if address is not None and not multiprocessing.util.is_abstract_socket_namespace(address):
        try:
            os.unlink(address)
        except OSError:
            pass


def _stop_resource_tracker(wait_s: float) -> None:
    """Close this process's end of ``_resource_tracker._fd``; reap the tracker it started within ``wait_s``."""
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        tracker._fd = tracker._pid = None
    _close(fd)
    deadline = time.monotonic() + wait_s
    while pid is not None:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                return
        except ChildProcessError:  # a forked process's copy of its parent's tracker
            return
        time.sleep(0.01)


def stop_worker_servers(wait_s: float = 5.0) -> None:
    """End and reap the fork server and resource tracker this process started; each starts again on next use."""
    _stop_forkserver()
    _stop_resource_tracker(wait_s)


def at_multiprocessing_exit(function: Any) -> None:
    """Call ``function()`` at a normal exit, after multiprocessing's own exit work (CPython 3.11.7's
    ``util._exit_function`` runs a negative ``exitpriority`` last)."""
    multiprocessing.util.Finalize(None, function, exitpriority=-100)


def raised_pickling_a_process(err: BaseException) -> bool:
    """Whether ``err`` was raised while multiprocessing pickled a process to start it (its traceback runs through
    CPython 3.11.7's ``multiprocessing/reduction.py`` ``dump``)."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "dump" and code.co_filename.endswith(os.path.join("multiprocessing", "reduction.py")):
            return True
        tb = tb.tb_next
    return False
