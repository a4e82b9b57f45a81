"""Lightning's DDP strategy with a launcher that is safe inside Hydra sweeps, a timeout in seconds, and a
rendezvous store that listens on loopback only for single-node runs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from typing_extensions import override

from dpddp._compat import Launcher, init_process_group, rank0_store, resolve_process_group_backend
from dpddp.parallel.launcher import JobLauncher, RankJob, Supervisor
from dpddp.parallel.rank import run_rank

__all__ = ["DDPStrategy"]


class DDPStrategy(LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` whose launcher starts ranks from a ``RankJob``, with a timeout in seconds.

    Args:
        job: what launched ranks run. ``None`` keeps Lightning's launcher (re-running ``sys.argv``), which only
            a plain script outside Hydra may use.
        timeout_s: seconds a collective waits for a lost peer before the run fails (torch's default is 1800).
        launch: how local ranks 1..n-1 start (with ``job`` only): ``"fork"`` (the launching process, with torch
            and Lightning imported already), ``"exec"`` (``python -m dpddp.parallel.rank``), or ``"auto"``:
            fork on CPU while CUDA is not initialised, exec otherwise.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``process_group_backend``, ``start_method``, and
            ``torch.nn.parallel.DistributedDataParallel`` options such as ``find_unused_parameters``).
    """

    def __init__(self, job: RankJob | None = None, timeout_s: float = 180.0, launch: str = "auto", **kwargs: Any):
        self.pg_timeout = timedelta(seconds=timeout_s)
        super().__init__(timeout=self.pg_timeout, **kwargs)
        self.job, self.launch_mode = job, launch
        self.start_method = kwargs.get("start_method", "popen")
        self._job_launcher: JobLauncher | None = None

    @property
    @override
    def launcher(self) -> Launcher | None:
        """Our ``JobLauncher`` for a ``popen`` launch with a job; else Lightning's. A public property that
        Lightning reads at every ``fit``/``test`` (rather than the private ``_configure_launcher`` it calls)."""
        if self.job is None or self.start_method != "popen":
            return super().launcher
        if self._job_launcher is None:
            assert self.cluster_environment is not None
            devices = self.parallel_devices or []
            on_cpu = bool(devices) and devices[0].type == "cpu"
            cpu_fork = self.launch_mode == "auto" and on_cpu and not torch.cuda.is_initialized()
            fork = self.launch_mode == "fork" or cpu_fork
            self._job_launcher = JobLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, self.job, fork, run_forked=run_rank
            )
        return self._job_launcher

    @property
    def supervisor(self) -> Supervisor | None:
        """The launcher that started this node's other ranks, if ours did; ``None`` otherwise."""
        return self._job_launcher

    @override
    def setup_distributed(self) -> None:
        """Lightning's, except on rank 0 of a single-node launch: the TCPStore takes the launcher's
        loopback-bound socket (see ``dpddp._compat.rank0_store``)."""
        launcher = self._job_launcher
        sock = launcher.listen_socket if launcher is not None else None
        if launcher is None or sock is None or torch.distributed.is_initialized():  # fit, then test: one group
            return super().setup_distributed()
        launcher.listen_socket = None
        reset_seed()
        self.set_world_ranks()
        backend = resolve_process_group_backend(self)
        store = rank0_store(sock, self.world_size, self.pg_timeout)
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, backend, self.pg_timeout, self.root_device, store)
