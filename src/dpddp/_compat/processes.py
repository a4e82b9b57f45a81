"""CPython multiprocessing's private names and behaviour dpddp relies on (the fork server and resource tracker that
DataLoader workers start from, and how a process start fails), and only here; checked in CPython ``CHECKED``,
tests/test_compat.py fails when one moves. See docs/design-notes.md (parallel.workers).
"""

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

__all__ = ["CHECKED", "at_multiprocessing_exit", "forget_forkserver", "raised_pickling_a_process"]
__all__ += ["FORK_SERVER_COMMAND", "forget_resource_sharer", "in_fork_server", "stop_worker_servers"]

CHECKED = "3.11.7"
"""The CPython version every entry below was read in and tested against."""

FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"
"""How the fork server's command (``python -c <command>``) begins: ``ForkServer.ensure_running``'s, CPython 3.11.7;
test_compat reads it there."""


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (``python -c`` with ``FORK_SERVER_COMMAND``), the
    workers it forks too; true while the server imports its preload modules."""
    return sys.orig_argv[-2:-1] == ["-c"] and sys.orig_argv[-1].startswith(FORK_SERVER_COMMAND)


def forget_forkserver() -> None:
    """In a process just forked from one that may have started ``multiprocessing``'s fork server: forget that
    server (close this copy of its keep-alive pipe, so it still ends with its own process; a new one starts on
    first use here). ``multiprocessing.forkserver._forkserver``'s fields, CPython 3.11.7: the module's functions
    are bound to that one instance, so it is reset in place; test_compat fails if they move."""
    server: Any = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._lock = threading.Lock()  # another thread of the parent may have held it at the fork


def forget_resource_sharer() -> None:
    """In a process just forked (``os.fork``) from one whose ``multiprocessing`` resource sharer may run (the
    thread that hands a tensor's file descriptor to a DataLoader worker, torch's ``file_descriptor`` sharing):
    forget it, so that this process's workers ask a sharer of its own (started on first use), not the parent's,
    which lacks this process's keys. ``multiprocessing.resource_sharer._resource_sharer``'s fields, CPython
    3.11.7; its own ``_afterfork`` is not called: closing the listener would unlink the parent's socket file.
    test_compat fails if they move."""
    sharer: Any = getattr(multiprocessing.resource_sharer, "_resource_sharer")  # noqa: B009 (typeshed lacks it)
    if sharer._listener is not None:
        sharer._listener._listener._socket.close()  # this process's copy only
    for _, close in sharer._cache.values():
        close()
    sharer._cache = {}
    sharer._lock = threading.Lock()  # another thread of the parent may have held it at the fork
    sharer._listener = sharer._address = sharer._thread = None


def _stop_forkserver() -> None:
    """SIGKILL and reap this process's fork server, if it started one (its stdlib stop, ``_stop``, closes the
    keep-alive pipe and waits while the server's interpreter finalizes torch and the rest it imported: seconds);
    the workers it forked get SIGKILL with it (``WorkerStart`` armed ``PR_SET_PDEATHSIG``). A new one starts on
    next use."""
    server: Any = multiprocessing.forkserver._forkserver
    with server._lock:
        pid, fd, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
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
    """Close this process's end of the resource tracker's pipe and reap the tracker if this process started it,
    waiting up to ``wait_s`` seconds for the tracker to see every other holder close (the workers it was handed
    to): it then unlinks what was left registered and exits. ``_resource_tracker._fd``/``_pid``, as its ``_stop``
    (which waits without a bound and raises in a forked process that inherited its parent's tracker)."""
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        tracker._fd = tracker._pid = None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while pid is not None:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                return
        except ChildProcessError:  # a forked process's copy of its parent's tracker
            return
        time.sleep(0.01)


def stop_worker_servers(wait_s: float = 5.0) -> None:
    """End the helper processes that multiprocessing started for this process's DataLoader workers, and reap them:
    the fork server (SIGKILL, its workers with it) and then the resource tracker (up to ``wait_s`` seconds). Each
    starts again on next use. Else they outlive the process that started them by seconds (the server's exit
    finalizes every module it imported) and are reaped by init."""
    _stop_forkserver()
    _stop_resource_tracker(wait_s)


def at_multiprocessing_exit(function: Any) -> None:
    """Call ``function()`` when this process exits normally, after multiprocessing's own exit work: its finalizers
    of priority >= 0 (a ``SemLock``'s, which tells the resource tracker, starting it again if stopped) and its joins
    of live child processes (``multiprocessing.util.Finalize`` with a negative ``exitpriority``, run last by
    ``util._exit_function``, CPython 3.11.7; test_compat fails if that order changes)."""
    multiprocessing.util.Finalize(None, function, exitpriority=-100)


def raised_pickling_a_process(err: BaseException) -> bool:
    """Whether ``err`` was raised while multiprocessing pickled a process to start it (its traceback runs through
    ``multiprocessing/reduction.py``'s ``dump``, which the fork server and spawn start methods call on the process
    object, CPython 3.11.7; test_compat fails if it is renamed). An up-front pickle of a loader's parts instead
    would differ from that one: multiprocessing's pickler moves tensors to shared memory and serves file
    descriptors from a thread; a plain pickle refuses what it pickles while spawning (queues, connections)."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "dump" and code.co_filename.endswith(os.path.join("multiprocessing", "reduction.py")):
            return True
        tb = tb.tb_next
    return False
