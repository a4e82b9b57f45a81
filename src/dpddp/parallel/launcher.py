"""Starting and supervising a DDP run's local ranks from a ``RankJob`` (docs/design-notes.md, parallel.launcher)."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, MutableMapping
from contextlib import suppress
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

import dpddp._compat as compat
from dpddp.cluster import LAUNCHED_ENV, master_address
from dpddp.diagnostics.network import route_interface
from dpddp.errors import EXIT_CRASH, EXIT_PREEMPTED, ConfigError, RankFailed, first_line

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What a launched rank needs, without Hydra or ``sys.argv``: ``entry`` (``"module:function"``, called with
    the job), the resolved ``config`` (JSON types), the run directory, the stage, the launcher's cwd and path."""

    ENV: ClassVar[str] = "DPDDP_JOB"

    entry: str
    config: dict[str, Any]
    output_dir: str
    stage: str = "fit"
    cwd: str = dataclasses.field(default_factory=os.getcwd)
    sys_path: tuple[str, ...] = dataclasses.field(default_factory=lambda: tuple(sys.path))

    def to_env(self) -> dict[str, str]:
        """``{RankJob.ENV: <json>}`` for an exec'd rank."""
        return {self.ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] = os.environ) -> RankJob:
        """The job that ``to_env`` wrote, taken out of ``environ``. Raises ``KeyError`` if ``$DPDDP_JOB`` is not set."""
        fields = json.loads(environ.pop(cls.ENV))
        return cls(**{**fields, "sys_path": tuple(fields["sys_path"])})

    def entry_function(self) -> Callable[[RankJob], Any]:
        """Import ``entry`` (with ``sys_path`` first on the import path) and return the function."""
        sys.path[:] = list(dict.fromkeys([*self.sys_path, *sys.path]))
        module, _, name = self.entry.partition(":")
        return getattr(importlib.import_module(module), name)


def die_with_parent() -> None:
    """In a launched rank: get SIGKILL when the launching process dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


_STOPPED = (EXIT_PREEMPTED, -signal.SIGTERM)  # a rank's exit status when SIGTERM stopped it


def _rank_ended(rank: int, proc: Any) -> str:
    """``"rank 1 (pid 4242) was killed by SIGKILL"`` or ``"... exited with code 1"``."""
    code = proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} (pid {proc.pid}) {how}"


def _watch_ranks(procs: list[Any], done: threading.Event, grace_s: float = 10.0) -> None:
    """Until ``done``: when a launched rank exits non-zero (after ``grace_s`` for SIGTERM's), kill the others and,
    unless rank 0 fails within ``grace_s`` seconds, end it with exit status 1."""
    while not done.wait(0.5):
        failed = [(r, p) for r, p in enumerate(procs, 1) if p.poll() not in (None, 0)]
        if not failed:
            continue
        rank, proc = failed[0]
        if proc.poll() in _STOPPED and done.wait(grace_s):
            return
        log.error(f"{_rank_ended(rank, proc)}; ending the run")
        for p in procs:
            p.kill()  # an ended one's is a no-op
        if not done.wait(grace_s):
            log.error(f"rank 0 is still waiting for rank {rank} after {grace_s:.0f} s; exiting")
            logging.shutdown()
            os._exit(EXIT_CRASH)  # the main thread may sit in a C++ wait that no Python signal handler reaches
        return


def _bind_store_socket(address: str) -> socket.socket:
    """Rank 0's TCPStore socket on ``address`` only, at ``$MASTER_PORT`` or a free port; ``ConfigError`` if taken."""
    port = int(master_address()[1] or 0)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, port), family=family, backlog=128)
    except OSError as err:
        fix = "unset MASTER_PORT to pick a free port, or choose another"
        why = os.strerror(err.errno or 0)
        raise ConfigError(f"MASTER_PORT={port} on {address} is not free ({why}): {fix}") from err


class _ForkedRank:
    """A forked local rank with the ``subprocess.Popen`` methods the launcher, the watcher and Lightning use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # the watcher polls while the main thread may wait

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = math.inf) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout)
            time.sleep(0.05)
        return code

    def send_signal(self, signum: int) -> None:  # Lightning's launcher.kill(signum) calls it
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class JobLauncher(compat.SubprocessScriptLauncher):
    """Lightning's ``_SubprocessScriptLauncher`` starting local ranks from ``job``: forked (``fork``: exiting with
    ``run_forked(job)``) or ``python -m dpddp.parallel.rank``; ``explain_failure(err)``: the peer to blame, or None."""

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        job: RankJob,
        fork: bool,
        run_forked: Callable[[RankJob], int],
        explain_failure: Callable[[BaseException], str | None],
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.job, self.fork, self.run_forked, self.explain_failure = job, fork, run_forked, explain_failure
        self.done = threading.Event()  # ends the rank watch
        self.listen_socket: socket.socket | None = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._start_ranks()
            threading.Thread(target=_watch_ranks, args=(self.procs, self.done), daemon=True, name="dpddp-ranks").start()
        compat.set_num_threads_if_needed(num_processes=self.num_processes)  # as Lightning's launch does
        try:
            return function(*args, **kwargs)
        except Exception as err:
            line = self.explain_failure(err)
            if line is None:
                raise
            raise RankFailed(f"{line}; ending the run (this rank: {first_line(err)})") from err

    def _start_ranks(self) -> None:  # once: the LOCAL_RANK it sets makes a later stage's processes external
        env = self.cluster_environment
        # Rank 0's store listens only on the address that routes to MASTER_ADDR (loopback on one node).
        route = route_interface(env.main_address) if self.num_nodes > 1 and env.node_rank() == 0 else None
        if self.num_nodes == 1 or route is not None:
            self.listen_socket = _bind_store_socket(env.main_address if route is None else route[1])
            os.environ["MASTER_PORT"] = str(self.listen_socket.getsockname()[1])
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            NODE_RANK=str(env.node_rank()),
            LOCAL_RANK=str(env.local_rank()),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        for local_rank in range(1, self.num_processes):
            if self.fork:
                self.procs.append(self._fork_rank(local_rank))  # type: ignore[arg-type]
                continue
            child_env = {**os.environ, "LOCAL_RANK": str(local_rank), LAUNCHED_ENV: "1", **self.job.to_env()}
            cmd = [sys.executable, "-m", "dpddp.parallel.rank"]
            self.procs.append(subprocess.Popen(cmd, env=child_env, cwd=self.job.cwd, preexec_fn=die_with_parent))
        how = "forked" if self.fork else "started with python -m dpddp.parallel.rank"
        if self.procs:
            log.info(f"local ranks 1-{self.num_processes - 1} {how}: pids {[p.pid for p in self.procs]}")

    def _fork_rank(self, local_rank: int) -> _ForkedRank:
        """Fork a rank that runs ``run_forked(job)`` and ``os._exit``s with its status."""
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads (torch's idle OpenMP pool)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return _ForkedRank(pid)
        code = EXIT_CRASH
        try:
            die_with_parent()
            if os.getppid() == parent:  # else the launcher died before prctl took effect
                if self.listen_socket is not None:
                    self.listen_socket.close()  # rank 0's store socket: only rank 0 keeps it
                compat.forget_forkserver()  # an earlier job's fork server is rank 0's: this rank's workers get theirs
                compat.forget_resource_sharer()  # likewise the sharer that hands tensors' descriptors to workers
                os.environ.update(LOCAL_RANK=str(local_rank), **{LAUNCHED_ENV: "1"})
                code = self.run_forked(self.job)
        except SystemExit as end:  # the rank's shell (dpddp.errors.shell) ends it with its status
            code = 0 if end.code is None else end.code if isinstance(end.code, int) else EXIT_CRASH
        finally:
            try:  # whatever fails here, this process ends here (never returns into the launcher's code)
                compat.stop_worker_servers()  # os._exit runs no exit handler: its fork server and tracker end here
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def failed_ranks(self, wait_s: float) -> list[str]:
        """Lines for the launched ranks that ended non-zero, waiting up to ``wait_s`` seconds in all."""
        deadline = time.monotonic() + wait_s
        failed = []
        for rank, proc in enumerate(self.procs, 1):
            with suppress(subprocess.TimeoutExpired):
                if proc.wait(timeout=max(deadline - time.monotonic(), 0.01)):
                    failed.append(_rank_ended(rank, proc))
        return failed

    def stopped(self) -> bool:
        """Whether a launched rank was stopped by SIGTERM."""
        return any(proc.poll() in _STOPPED for proc in self.procs)

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for launched ranks to exit, then kill any left."""
        self.done.set()
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
            proc.kill()  # a no-op once it ended
            proc.wait()
