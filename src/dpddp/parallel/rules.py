"""The device and strategy settings a run may have, each bad one refused, and ``resolve_world``, their ``World``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import dpddp.cluster as launch
from dpddp._compat import registered_strategies
from dpddp.diagnostics.allreduce import COMM_HOOKS
from dpddp.errors import ConfigError, checked_float, checked_int, local_rank

STRATEGIES = ("auto", "dp", "ddp", "ddp_spawn")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
CLUSTERS = ("auto", "kubeflow")
DDP_FAMILY = ("ddp", "ddp_spawn")  # the strategies that run one process per device; the others run one


def is_ddp_family(strategy: str) -> bool:
    """Whether the strategy named ``strategy`` runs one process per device (``DDP_FAMILY``)."""
    return strategy in DDP_FAMILY


DDP_OPTIONS: tuple[str, ...] = ("process_group_backend", "timeout_s", "launch", "start_method", "ddp_comm_hook")
DDP_OPTIONS += ("powersgd_rank", "powersgd_start_iter")  # the others are DistributedDataParallel's arguments


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` -> ``gpu`` when CUDA is available, else ``cpu``; ``cuda`` is ``gpu``."""
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


@dataclass(frozen=True)
class World:
    """The processes a run has and this process's place among them. ``family``: ``"ddp"``, ``"dp"`` or ``"one"``;
    ``devices``: per node (``devices=-1``: the visible GPUs); ``writes_outputs``: global rank 0, not a launched rank."""

    strategy: str
    family: str
    accelerator: str
    devices: int
    nodes: int
    processes_per_node: int
    world_size: int
    world_size_source: str
    replicas: int
    global_rank: int
    local_rank: int
    writes_outputs: bool
    launch_id: str | None


def world_of(cfg: Mapping) -> World:
    """The ``World`` of ``cfg``'s device settings, unchecked (``resolve_world`` checks them); ``num_nodes=auto`` under
    DDP: a launcher's world size over ``devices``, else 1 node."""
    strategy = cfg["strategy"]["name"]
    family = "ddp" if is_ddp_family(strategy) else "dp" if strategy == "dp" else "one"
    devices = cfg["devices"] if cfg["devices"] != -1 else torch.cuda.device_count()
    elastic = launch.cluster_world_size(cfg["cluster"]) if family == "ddp" and cfg["num_nodes"] == "auto" else None
    nodes = 1 if cfg["num_nodes"] == "auto" else cfg["num_nodes"]
    if elastic is not None:
        nodes = max(elastic[0] // max(devices, 1), 1)
    size = devices * nodes if family == "ddp" else 1
    return World(
        strategy=strategy,
        family=family,
        accelerator=resolve_accelerator(cfg["accelerator"]),
        devices=devices,
        nodes=nodes,
        processes_per_node=devices if family == "ddp" else 1,
        world_size=size,
        world_size_source=f"{elastic[1]}={elastic[0]}" if elastic else "devices x num_nodes",
        replicas=devices if family == "dp" else size,
        global_rank=launch.node_rank() * devices + local_rank() if launch.launched_by_dpddp() else launch.env_rank(),
        local_rank=local_rank(),
        writes_outputs=launch.writes_outputs(),
        launch_id=launch.launch_id(),
    )


def resolve_world(cfg: Mapping) -> World:
    """The run's checked ``World``; ``ConfigError`` naming the first setting this machine or cluster cannot run."""
    strategy, devices, num_nodes = cfg["strategy"]["name"], cfg["devices"], cfg["num_nodes"]
    ddp = is_ddp_family(strategy)
    if strategy not in STRATEGIES:  # a Lightning name: dpddp's settings for it
        unknown = f"strategy={strategy!r} is unknown: choose one of {', '.join(STRATEGIES)}"
        raise ConfigError(lightning_name_line(strategy) or unknown)
    if cfg["accelerator"] not in ACCELERATORS:
        raise ConfigError(f"accelerator={cfg['accelerator']!r} is unknown: choose one of {', '.join(ACCELERATORS)}")
    if devices != -1:
        checked_int("devices", devices, 1, "use a positive number of devices per node, or -1 for all GPUs")
    if num_nodes != "auto":
        checked_int("num_nodes", num_nodes, 1, "use a positive number of nodes, or auto (the launcher's)")
    accelerator = resolve_accelerator(cfg["accelerator"])
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError(f"accelerator={cfg['accelerator']} but CUDA is not available: use accelerator=cpu")
    if accelerator == "cpu" and devices == -1:
        raise ConfigError("devices=-1 (all GPUs) on CPU: give a number of CPU processes, e.g. devices=2")
    if accelerator == "gpu" and devices > torch.cuda.device_count():
        raise ConfigError(f"devices={devices} but {torch.cuda.device_count()} GPUs are visible: lower devices")
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and devices > 4 * cores:
        raise ConfigError(f"devices={devices} CPU processes on {cores} cores: use at most {4 * cores}")
    if strategy == "dp" and accelerator == "cpu" and devices > 1:
        fix = f"use strategy=ddp devices={devices}"
        raise ConfigError(f"strategy=dp with devices={devices} on CPU: DataParallel needs GPUs: {fix}")
    if strategy in ("auto", "dp") and num_nodes != "auto" and num_nodes > 1:
        by_hand = "MASTER_ADDR (node 0's address), MASTER_PORT and NODE_RANK set on each"
        fix = f"use strategy=ddp, with each node started by torchrun or SLURM, or with {by_hand}"
        raise ConfigError(f"num_nodes={num_nodes} needs one process per device: {fix}")
    if strategy == "auto" and devices != 1:
        raise ConfigError(f"strategy=auto runs on one device, not devices={devices}: use strategy=ddp (or dp on GPUs)")
    if cfg["cluster"] not in CLUSTERS:
        raise ConfigError(f"cluster={cfg['cluster']!r} is unknown: choose one of {', '.join(CLUSTERS)}")
    check_strategy_options(cfg["strategy"])
    launch.check_launch_variables(cfg["cluster"], 1 if num_nodes == "auto" else num_nodes, ddp)  # before world_of
    world = world_of(cfg)
    started = launch.cluster_world_size(cfg["cluster"])
    cluster = f"{started[1]}={started[0]}" if started else ""
    if started and num_nodes == "auto" and ddp:  # elastic: devices x nodes must be the launcher's
        (run_id, local), per_node = launch.torchrun_node(), world.devices
        if local is not None and local.isdigit() and int(local) != per_node:
            here = f"torchrun started {local} processes on this node (LOCAL_WORLD_SIZE={local})"
            fix = f"set devices={local}, or torchrun --nproc_per_node={per_node}"
            raise ConfigError(f"devices={per_node} but {here}: {fix}")
        if started[0] % per_node:
            which = f"which devices={per_node} per node does not divide: set devices to the processes per node"
            raise ConfigError(f"num_nodes=auto: the cluster started {started[0]} processes ({cluster}), {which}")
        if run_id == "none":
            why = "every start of an elastic job finds its run directory and last.ckpt by the job's id"
            fix = "add torchrun --rdzv-id=<job id>"
            raise ConfigError(f"num_nodes=auto under torchrun without --rdzv-id: {why}: {fix}")
    if started and not ddp and started[0] > 1:  # each process would train alone
        alone = f"strategy={strategy} runs one (each would train alone)"
        fix = f"use strategy=ddp with devices x num_nodes = {started[0]}"
        raise ConfigError(f"the cluster started {started[0]} processes ({cluster}) but {alone}: {fix}")
    if started and ddp and started[0] != world.world_size:
        given = f"devices={devices} x num_nodes={num_nodes} = {world.world_size} processes"
        fix = "make devices x num_nodes match the cluster's tasks"
        raise ConfigError(f"{given}, but the cluster started {started[0]} ({cluster}): {fix}")
    return world


def check_strategy_options(options: Mapping) -> None:
    """The ``strategy.*`` options (and ``MASTER_PORT``) dpddp's DDP strategy can take; else ``ConfigError``."""
    if "timeout_s" in options:
        fix = "use seconds, e.g. strategy.timeout_s=180"
        checked_float("strategy.timeout_s", options["timeout_s"], 1.0, 7 * 86400.0, fix)
    backend = options.get("process_group_backend")
    if backend not in (None, "gloo", "nccl", "mpi", "ucc"):
        raise ConfigError(f"strategy.process_group_backend={backend!r} is unknown: use null (automatic), gloo or nccl")
    built = {"nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available, "ucc": dist.is_ucc_available}
    if backend in built and not built[backend]():
        fix = "use null (automatic) or gloo"
        raise ConfigError(f"strategy.process_group_backend={backend!r} is not built into this torch: {fix}")
    if options.get("launch", "auto") not in ("auto", "fork", "exec"):
        raise ConfigError(f"strategy.launch={options['launch']!r} is unknown: use auto, fork (CPU) or exec")
    start = options.get("start_method")
    if start not in (None, "popen"):  # Lightning's multiprocessing launchers would write no SIGTERM checkpoint
        does = "a fresh interpreter per rank, as strategy=ddp_spawn does"
        fix = f"remove it and choose strategy.launch=fork (CPU) or exec ({does})"
        raise ConfigError(f"strategy.start_method={start!r} is not offered: dpddp starts the ranks itself; {fix}")
    hook = options.get("ddp_comm_hook")
    if hook is not None and hook not in tuple(COMM_HOOKS):  # a tuple: a plain list or dict value is unhashable
        *names, last = COMM_HOOKS
        raise ConfigError(f"strategy.ddp_comm_hook={hook!r} is unknown: use null, {', '.join(names)} or {last}")
    if hook == "bf16_compress" and backend not in (None, "nccl") and torch.cuda.is_available():
        given = f"strategy.ddp_comm_hook=bf16_compress with strategy.process_group_backend={backend}"
        fix = "use process_group_backend=null (NCCL on GPUs) or nccl, or fp16_compress"
        raise ConfigError(f"{given} cannot all-reduce bf16 GPU gradients: {fix}")  # gloo: bf16 CPU tensors only
    if "powersgd_rank" in options:
        checked_int("strategy.powersgd_rank", options["powersgd_rank"], 1, "use a small rank, e.g. 1, 2 or 4")
    if "powersgd_start_iter" in options:  # torch's PowerSGDState: error feedback and warm start need 2 or more
        fix = "use 2 or more (plain all-reduce before it), e.g. 10"
        checked_int("strategy.powersgd_start_iter", options["powersgd_start_iter"], 2, fix)
    for key in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
        if key in options and not isinstance(options[key], bool):
            raise ConfigError(f"strategy.{key}={options[key]!r} is invalid: use true or false")
    port = launch.master_address()[1]
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"MASTER_PORT={port!r} (environment) is not a port: unset it or use 1-65535")


def lightning_equivalent(name: str) -> tuple[str, ...] | None:
    """dpddp's settings for a Lightning strategy name it can run (``ddp_fork``: ``strategy.launch=fork``), or None."""
    cls, params = registered_strategies().get(name, (None, {}))
    if cls is SingleDeviceStrategy:
        return ("strategy=auto",)
    if name in STRATEGIES or cls is not DDPStrategy or set(params) - {"start_method", "find_unused_parameters"}:
        return None
    launches = {"popen": "strategy=ddp", "spawn": "strategy=ddp_spawn", "fork": "strategy=ddp strategy.launch=fork"}
    if (settings := launches.get(params.get("start_method", "popen"))) is None:
        return None
    unused = ("strategy.find_unused_parameters=true",) if params.get("find_unused_parameters") else ()
    return (*settings.split(), *unused)


def lightning_name_line(name: str, prefix: str = "") -> str | None:
    """The line for ``<prefix>strategy=<name>``, a Lightning name dpddp lacks: what to use; ``None`` for others."""
    cls, params = registered_strategies().get(name, (None, {}))
    if name in STRATEGIES or cls is None:
        return None
    if (settings := lightning_equivalent(name)) is not None:
        given = ", ".join(f"{k}={v!r}" for k, v in sorted(params.items()))
        return f"{prefix}strategy={name} is Lightning's name for {cls.__name__}({given}): use {' '.join(settings)}"
    own = f"dpddp keeps its promises with its own strategies: {', '.join(STRATEGIES)}"
    fix = f"use {prefix}strategy=ddp, or {prefix}strategy=dp on GPUs"
    return f"{prefix}strategy={name} ({cls.__name__}) is not offered ({own}): {fix}"
