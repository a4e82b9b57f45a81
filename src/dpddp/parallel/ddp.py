"""The parallel plumbing: the ``dp`` strategy Lightning 2.x removed, and a DDP launcher safe inside Hydra.

``DataParallelStrategy`` (registered as ``"dp"``): one process, world size 1. The LightningModule's
``forward`` is replaced, for the duration of a run, by ``torch.nn.DataParallel`` over the GPUs: the batch is
scattered along dim 0, the forward runs in replicas, outputs are gathered on the root device (the first GPU).
Everything else (loss, backward, optimizer step, metrics, ``self.log``) runs once on the root device, so no
``*_step_end`` reduction is needed (those hooks were removed in Lightning 2.0).

``DDPStrategy``: Lightning's DDP, whose launcher starts local ranks 1..n-1 from the job's resolved config
instead of re-running ``sys.argv`` (Lightning's ``_hydra_subprocess_cmd`` replays the whole command line, so
inside ``-m`` every child starts a sweep of its own): on CPU by forking the launching process (no second
import of torch and Lightning: the rank reaches its first step seconds sooner, like Lightning's ``ddp_fork``),
on GPUs with ``python -m dpddp.launch`` (a fresh interpreter: CUDA does not survive a fork). The children die
with their parent (``PR_SET_PDEATHSIG``) so a killed launcher leaves no orphan.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection, _set_num_threads_if_needed
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)
from torch import nn

from dpddp.cluster import loopback_interface
from dpddp.config import ConfigError

__all__ = ["DDPStrategy", "DataParallelStrategy", "JOB_ENV", "RankFailed", "replicate_forward", "restore_forward"]

log = logging.getLogger(__name__)

JOB_ENV = "DPDDP_JOB"
"""Environment variable carrying a launched rank's job (resolved config and run directory) as JSON."""


class _Forward(nn.Module):
    """Runs ``type(module).forward`` on ``module``; replicated by DataParallel, each replica calls the class's
    forward on its own copy of the LightningModule (the instance-level patch is bypassed, so no recursion)."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


def replicate_forward(module: pl.LightningModule, device_ids: list[int]) -> nn.DataParallel:
    """Route ``module(x)`` through ``nn.DataParallel`` over ``device_ids`` (root: ``device_ids[0]``) until
    ``restore_forward(module)``. Only the forward is replicated; the module itself, its hooks, metrics and
    state dict are untouched (the wrapper is an instance attribute, not a registered submodule)."""
    out = device_ids[0] if device_ids else None
    replicated = nn.DataParallel(_Forward(module), device_ids=device_ids, output_device=out)
    module.__dict__["forward"] = replicated.__call__  # nn.Module.__call__ looks up self.forward
    return replicated


def restore_forward(module: pl.LightningModule) -> None:
    """Undo ``replicate_forward``."""
    module.__dict__.pop("forward", None)


class DataParallelStrategy(SingleDeviceStrategy):
    """Single-process data parallelism over several GPUs with ``torch.nn.DataParallel``.

    World size 1: the loader yields the whole global batch (``[B, ...]``); ``DataParallel`` splits it into
    ``len(devices)`` chunks along dim 0 (``torch.chunk`` sizes, so uneven or tiny batches work), runs the
    forward on each GPU and concatenates the outputs ``[B, ...]`` on the root device ``cuda:<first id>``.
    Checkpoints hold the plain module's weights (the wrapper is never registered on the module), so they load
    under any other strategy and the reverse. On CPU with one device the module runs unwrapped.

    Raises:
        ValueError: at Trainer construction, for more than one CPU device (DataParallel replicates over CUDA
            GPUs only; use ``strategy=ddp`` for several CPU processes).
    """

    strategy_name = "dp"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self._parallel_devices: list[torch.device] = []  # empty: Lightning's connector fills it from `devices`
        self._replicated: nn.DataParallel | None = None

    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        devices = devices or [torch.device("cpu")]
        if len(devices) > 1 and devices[0].type != "cuda":
            raise ValueError(
                f"strategy=dp with devices={len(devices)} on {devices[0].type}: DataParallel replicates over "
                f"CUDA GPUs in one process; for several CPU processes use strategy=ddp devices={len(devices)}"
            )
        self._parallel_devices = devices
        self._root_device = devices[0]

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        if len(self._parallel_devices) > 1 and module is not None:
            self._replicated = replicate_forward(module, [d.index for d in self._parallel_devices])

    def teardown(self) -> None:
        module = self.lightning_module
        if self._replicated is not None and module is not None:
            restore_forward(module)
            self._replicated = None
        super().teardown()


StrategyRegistry.register(
    "dp", DataParallelStrategy, description="DataParallel: one process, forward replicated over GPUs", override=True
)


class RankFailed(RuntimeError):
    """A launched rank ended with a non-zero status, and rank 0's run failed with it (the message says which
    rank, its pid and status, and rank 0's own error)."""


def _die_with_parent() -> None:
    """In a launched rank (before exec): get SIGKILL when the launching process dies (Linux ``prctl``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _rank_ended(rank: int, proc: Any) -> str:
    """``"rank 1 (pid 4242) was killed by SIGKILL"`` or ``"... exited with code 1"`` for an ended rank."""
    code = proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} (pid {proc.pid}) {how}"


class _RankWatcher(threading.Thread):
    """Watches launched ranks; when one exits non-zero, kills the others and, if rank 0 has not failed by
    itself within ``grace_s`` seconds (it normally does at once: gloo and nccl collectives fail when a peer's
    connection drops; a wait on the rendezvous store does not), ends rank 0 with exit status 1."""

    def __init__(self, procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
        super().__init__(daemon=True, name="dpddp-rank-watcher")
        self.procs, self.grace_s, self.done = procs, grace_s, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            failed = [(r, p) for r, p in enumerate(self.procs, 1) if p.poll() not in (None, 0)]
            if failed:
                rank, proc = failed[0]
                log.error(f"{_rank_ended(rank, proc)}; ending the run")
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                if not self.done.wait(self.grace_s):
                    log.error(f"rank 0 is still waiting for rank {rank} after {self.grace_s:.0f} s; exiting")
                    logging.shutdown()
                    os._exit(1)  # the main thread may sit in a C++ wait that no Python signal handler reaches
                return


def _bind_store_socket(address: str) -> socket.socket:
    """A listening socket for rank 0's TCPStore on ``address`` only (torch's own store listens on every
    interface), on ``$MASTER_PORT`` if set, else on a free port. Held from before the other ranks start until
    the store takes it, so two runs on one machine cannot pick the same port.

    Raises:
        ConfigError: ``MASTER_PORT`` is already in use (case 05), before any rank is started.
    """
    port = int(os.environ.get("MASTER_PORT", 0))
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"MASTER_PORT={port} on {address} is not free ({err.strerror}): unset MASTER_PORT to pick a free port, "
            "or choose another"
        ) from err
    sock.listen(128)
    return sock


class _ForkedRank:
    """A local rank forked from the launching process, with the part of ``subprocess.Popen``'s interface the
    launcher and the watcher use (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None
        self._lock = threading.Lock()  # the watcher polls while the main thread may wait

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _JobLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, starting ranks from the job's resolved config (see module doc)."""

    def __init__(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, job: dict, fork: bool
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.job, self.fork = job, fork
        self.watcher: _RankWatcher | None = None
        self.listen_socket: socket.socket | None = None

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self.watcher = _RankWatcher(self.procs)
            self.watcher.start()
        # Lightning's launch does this too: cores / processes intra-op threads unless OMP_NUM_THREADS is set.
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        env = self.cluster_environment
        if self.num_nodes == 1:
            self.listen_socket = _bind_store_socket(env.main_address)
            os.environ["MASTER_PORT"] = str(self.listen_socket.getsockname()[1])
            interface = loopback_interface() if ipaddress.ip_address(env.main_address).is_loopback else None
            if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = interface  # gloo's pair sockets: loopback only
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            NODE_RANK=str(env.node_rank()),
            LOCAL_RANK=str(env.local_rank()),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        for local_rank in range(1, self.num_processes):
            if self.fork:
                self.procs.append(self._fork_rank(local_rank))
                continue
            child_env = {**os.environ, "LOCAL_RANK": str(local_rank), JOB_ENV: json.dumps(self.job)}
            cmd = [sys.executable, "-m", "dpddp.launch"]
            self.procs.append(subprocess.Popen(cmd, env=child_env, preexec_fn=_die_with_parent))
        how = "forked" if self.fork else "started with python -m dpddp.launch"
        if self.procs:
            log.info(f"local ranks 1-{self.num_processes - 1} {how}: pids {[p.pid for p in self.procs]}")

    def _fork_rank(self, local_rank: int) -> _ForkedRank:
        """Fork local rank ``local_rank``: it runs ``dpddp.launch.run_rank(job)`` and ``os._exit``s with its
        status (never returning into the launcher's caller, so no Hydra or sweep code runs twice)."""
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads (torch's idle OpenMP pool)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return _ForkedRank(pid)
        code = 1
        try:
            _die_with_parent()
            if os.getppid() == parent:  # else the launcher died before prctl took effect
                if self.listen_socket is not None:
                    self.listen_socket.close()  # rank 0's store socket: only rank 0 keeps it
                os.environ["LOCAL_RANK"] = str(local_rank)
                from dpddp.launch import run_rank

                code = run_rank(self.job)
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def failed_ranks(self, wait_s: float) -> list[str]:
        """Launched ranks that ended with a non-zero status, waiting up to ``wait_s`` seconds in all for them to
        end (a rank killed by a signal drops its connections just before its parent can see it exit), e.g.
        ``["rank 1 (pid 4242) was killed by SIGKILL"]``."""
        deadline = time.monotonic() + wait_s
        failed = []
        for rank, proc in enumerate(self.procs, 1):
            try:
                code = proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                continue
            if code:
                failed.append(_rank_ended(rank, proc))
        return failed

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for launched ranks to exit, then kill any left."""
        if self.watcher is not None:
            self.watcher.done.set()
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with a Hydra-safe launcher and a timeout in seconds.

    Args:
        job: the job to hand to launched ranks: ``{"config": <resolved config dict>, "output_dir": str}``.
            ``None`` keeps Lightning's launcher (re-running ``sys.argv``), which is right outside Hydra.
        timeout_s: seconds a collective waits for a lost peer before the run fails (torch's default is 1800).
        launch: how the launcher starts local ranks 1..n-1 (with ``job`` only): ``"fork"`` (the launching
            process, with torch and Lightning imported already), ``"exec"`` (``python -m dpddp.launch``), or
            ``"auto"``: fork on CPU while CUDA is not initialised, exec otherwise.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``process_group_backend``, ``start_method``, and
            ``torch.nn.parallel.DistributedDataParallel`` options such as ``find_unused_parameters``).
    """

    def __init__(self, job: dict | None = None, timeout_s: float = 180.0, launch: str = "auto", **kwargs: Any) -> None:
        super().__init__(timeout=timedelta(seconds=timeout_s), **kwargs)
        self.job, self.launch = job, launch

    def setup_distributed(self) -> None:
        """Lightning's, except on rank 0 of a single-node launch: the TCPStore takes the launcher's
        loopback-bound socket (``master_listen_fd``, which needs torch's non-libuv store)."""
        sock = getattr(self._launcher, "listen_socket", None)
        if sock is None or torch.distributed.is_initialized():  # fit, then test: one process group
            return super().setup_distributed()
        self._launcher.listen_socket = None
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        address, port = sock.getsockname()[:2]
        store = torch.distributed.TCPStore(
            address, port, self.world_size, is_master=True, timeout=self._timeout, wait_for_workers=False,
            master_listen_fd=sock.detach(), use_libuv=False,
        )  # fmt: skip
        # The other ranks rendezvous through env://, which torch wraps in PrefixStore("default_pg", ...);
        # a store passed in is used as it is, so wrap it alike for the keys to meet.
        store = torch.distributed.PrefixStore("default_pg", store)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, store=store,
            device_id=device_id,
        )  # fmt: skip

    def _configure_launcher(self) -> None:
        if self._start_method == "popen" and self.job is not None:
            assert self.cluster_environment is not None
            on_cpu = bool(self.parallel_devices) and self.parallel_devices[0].type == "cpu"
            fork = self.launch == "fork" or (self.launch == "auto" and on_cpu and not torch.cuda.is_initialized())
            env, n = self.cluster_environment, self.num_processes
            self._launcher = _JobLauncher(env, n, self.num_nodes, self.job, fork=fork)
        else:
            super()._configure_launcher()
