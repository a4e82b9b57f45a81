"""Lightning's DDP strategy with dpddp's launcher, network interface, rendezvous, peer watch and whereabouts."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from typing_extensions import override

import dpddp._compat as compat
from dpddp.diagnostics.allreduce import COMM_HOOKS, AllReduceTimer
from dpddp.diagnostics.network import choose_interface, interface_address
from dpddp.diagnostics.whereabouts import METRIC_SYNC, Whereabouts, current, entering
from dpddp.errors import ConfigError, Preempted, ReplicasDiverged, StepFailed, first_line
from dpddp.messages import unused_parameters
from dpddp.parallel.launcher import JobLauncher, RankJob
from dpddp.parallel.peers import PeerWatch, join_start
from dpddp.parallel.rank import run_rank
from dpddp.parallel.workers import start_workers_safely

log = logging.getLogger(__name__)


def _is_loopback(address: str | None) -> bool:
    with contextlib.suppress(ValueError):
        return address == "localhost" or ipaddress.ip_address(str(address).partition("%")[0]).is_loopback
    return False


def apply_interface(master_addr: str, num_nodes: int) -> str:
    """Set ``choose_interface``'s variables for ``master_addr``, return why; ``ConfigError``: nodes over loopback."""
    updates, why = choose_interface(master_addr)
    name = updates.get("GLOO_SOCKET_IFNAME")
    if num_nodes > 1 and name is not None and _is_loopback(interface_address(name)) and not _is_loopback(master_addr):
        looped = f"MASTER_ADDR={master_addr} is reached through this machine's loopback ({why})"
        fix = "set MASTER_ADDR (torchrun --master_addr) to node 0's address on the cluster network"
        raise ConfigError(f"{looped}, so other nodes cannot reach it: {fix}")
    os.environ.update(updates)
    return why


UNUSED_PARAMETERS_LINE = (
    "a parameter got no gradient in the last training step (DDP waits for each one's): set "
    "strategy.find_unused_parameters=true (CLI: --trainer.strategy=ddp_find_unused_parameters_true) or use it"
)


class DDPStrategy(LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` whose launcher starts ranks from ``job`` (``None``: Lightning's) by ``launch``
    (``fork``, ``exec``; ``auto``: fork on CPU before CUDA), timing the all-reduce; ``**kwargs`` go to Lightning's."""

    def __init__(
        self,
        job: RankJob | None = None,
        timeout_s: float = 180.0,
        launch: str = "auto",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        **kwargs: Any,
    ):
        self.pg_timeout = timedelta(seconds=timeout_s)
        hook = kwargs.get("ddp_comm_hook")
        self.comm_state: PowerSGDState | None = None
        if hook == "powersgd":
            kwargs["ddp_comm_state"] = self.comm_state = PowerSGDState(None, powersgd_rank, powersgd_start_iter)
        self._layout: dict[int, list[int]] = {}  # PowerSGD: each bucket's parameters, as the last backward had them
        self._restored_layout: list[list[int]] | None = None
        self._param_index: dict[int, int] = {}
        self.allreduce_timer = AllReduceTimer() if hook is None else AllReduceTimer(COMM_HOOKS[hook])  # rules-checked
        self._hook = self.allreduce_timer.hook if self.comm_state is None else self._recording_hook
        kwargs["ddp_comm_hook"] = self._hook
        super().__init__(timeout=self.pg_timeout, **kwargs)
        self.job, self.launch_mode = job, launch
        self.supervisor: JobLauncher | None = None  # the launcher that started this node's other ranks, if ours did
        self._peer_watch: PeerWatch | None = None
        self._whereabouts: Whereabouts | None = None
        self._prefix = "dpddp/0/"  # this start's keys in the rendezvous store (``join_start`` under torchrun)

    @property
    @override
    def launcher(self) -> compat.Launcher | None:
        if self.job is None:
            return super().launcher
        if self.supervisor is None:
            env = self.cluster_environment
            assert env is not None
            cpu = [d.type for d in self.parallel_devices or []][:1] == ["cpu"] and not torch.cuda.is_initialized()
            fork = self.launch_mode == "fork" or (self.launch_mode == "auto" and cpu)
            self.supervisor = JobLauncher(
                env, self.num_processes, self.num_nodes, self.job, fork, run_rank, self.explain_failure
            )
        return self.supervisor

    @override
    def setup_distributed(self) -> None:
        """Lightning's on the chosen interface, with ``PeerWatch``, ``Whereabouts``; ``ConfigError``, ``RankFailed``."""
        env = self.cluster_environment
        assert env is not None
        initialized = torch.distributed.is_initialized()  # fit, then test: one group
        store: torch.distributed.Store | None = None
        self.set_world_ranks()
        if not initialized:
            log.info(f"network: {apply_interface(env.main_address, self.num_nodes)}")
            client = compat.agent_store(env.main_address, env.main_port, self.pg_timeout)
            if client is not None:
                self._prefix = join_start(
                    client, self.global_rank, self.world_size, self.num_processes, self.pg_timeout.total_seconds()
                )
                store = torch.distributed.PrefixStore(f"{self._prefix}default_pg", client)
        if self.num_nodes > 1 and self._peer_watch is None:
            self._peer_watch = PeerWatch(
                env.main_address, env.main_port, self.global_rank, self.world_size,
                self.num_processes, self.pg_timeout.total_seconds(), self._prefix,
            )  # fmt: skip
            self._peer_watch.start()
        launcher = self.supervisor
        sock = launcher.listen_socket if launcher is not None else None
        if initialized or (store is None and sock is None):
            super().setup_distributed()
        else:
            reset_seed()
            backend = compat.resolve_process_group_backend(self)
            if sock is not None:
                assert launcher is not None
                launcher.listen_socket = None
                store = compat.rank0_store(sock, self.world_size, self.pg_timeout)
            compat.init_process_group(env, backend, self.pg_timeout, self.root_device, store)
        if self._whereabouts is None:
            self._whereabouts = Whereabouts(
                env.main_address, env.main_port, self.global_rank, self.world_size, self._prefix, self._position
            )
            self._whereabouts.start()

    def _position(self) -> tuple[str, int]:
        """The trainer's ``(stage, global_step)``, ``("setup", 0)`` before one."""
        try:
            trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):  # no module yet, or one not attached to a trainer
            return "setup", 0
        stage = trainer.state.stage
        return (stage.value if stage is not None else "setup"), trainer.global_step

    @override
    def configure_ddp(self) -> None:
        """Lightning's, with the comm hook on CPU too, over the parameters a ``BaseFinetuning`` callback froze."""
        module = self.lightning_module
        assert module is not None
        with contextlib.ExitStack() as stack:
            if any(isinstance(c, BaseFinetuning) for c in getattr(module.trainer, "callbacks", [])):
                stack.enter_context(compat.wrapping_frozen(self, module))
            if self.comm_state is not None:
                params = stack.enter_context(compat.bucket_assignment(self._restored_layout))
            super().configure_ddp()
        if self.comm_state is not None:
            self._param_index = {id(p): i for i, p in enumerate(params)}
        if self.root_device.type != "cuda":
            assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
            self.model.register_comm_hook(self.comm_state, self._hook)

    def _recording_hook(self, state: Any, bucket):  # no annotations on bucket and the return: DDP checks them
        self._layout[bucket.index()] = [self._param_index[id(p)] for p in bucket.parameters()]
        return self.allreduce_timer.hook(state, bucket)

    def comm_state_dict(self) -> dict[str, Any] | None:
        """This rank's PowerSGD state and its bucket layout, or ``None`` without PowerSGD."""
        if self.comm_state is None:
            return None
        layout = [self._layout[i] for i in sorted(self._layout)]
        return {"powersgd": compat.powersgd_state(self.comm_state), "layout": layout}

    def load_comm_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a ``comm_state_dict`` before ``configure_ddp``: the state, and DDP's first buckets as saved."""
        assert self.comm_state is not None
        compat.load_powersgd_state(self.comm_state, saved["powersgd"], self.root_device)
        self._restored_layout = [list(b) for b in saved["layout"]] or None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's. Raises ``StepFailed`` with ``UNUSED_PARAMETERS_LINE`` for DDP's unused-parameter error."""
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as err:
            if not unused_parameters(str(err)):
                raise
            raise StepFailed(f"rank {self.global_rank}: {UNUSED_PARAMETERS_LINE}") from err

    # The collectives below are Lightning's, marked for ``Whereabouts``.
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        with entering(METRIC_SYNC):
            return super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        with entering(current() or "Lightning's all_gather"):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with entering("a barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with entering("a broadcast"):
            return super().broadcast(obj, src)

    def explain_failure(self, err: BaseException) -> str | None:
        """The line naming the peer to blame for ``err``, or ``None`` (its own, told to the peers); stops the watch."""
        watch, self._peer_watch = self._peer_watch, None
        if isinstance(err, (ConfigError, Preempted, ReplicasDiverged)):  # every rank's own
            return None
        where = self._whereabouts
        line = (watch.explain() if watch is not None else None) or (where.explain() if where is not None else None)
        if watch is not None:
            watch.report(line or f"rank {self.global_rank} (node {self.node_rank}) failed: {first_line(err)}")
            watch.stop(clean=False)
        return line

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return start_workers_safely(dataloader, self.global_rank)

    @override
    def teardown(self) -> None:
        for watch in (self._peer_watch, self._whereabouts):
            if watch is not None:
                watch.stop()
        self._peer_watch = self._whereabouts = None
        super().teardown()
