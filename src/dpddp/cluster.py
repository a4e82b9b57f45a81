"""The only reader of the launcher's variables (torchrun, SLURM, a PyTorchJob, dpddp's): ranks, world, run name."""

from __future__ import annotations

import os
import re
import sys
import time

from omegaconf import OmegaConf

from dpddp.diagnostics.network import is_local_address
from dpddp.errors import EXIT_CONFIG, ConfigError
from dpddp.errors import local_rank as local_rank


def env_rank() -> int:
    """``RANK`` (torchrun, a PyTorchJob), else ``SLURM_PROCID``, else 0."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def writes_outputs() -> bool:
    """Whether this process writes the run's outputs: global rank 0, not started by dpddp's launcher."""
    return env_rank() == 0 and not launched_by_dpddp()


def launched_by_dpddp() -> bool:
    return bool(os.environ.get(LAUNCHED_ENV))


def node_rank() -> int:
    return int(os.environ.get("NODE_RANK", 0))


def master_address() -> tuple[str | None, str | None]:
    return os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")


def torchrun_node() -> tuple[str | None, str | None]:
    """``(TORCHELASTIC_RUN_ID, LOCAL_WORLD_SIZE)`` under torchrun (``"none"``: no ``--rdzv-id``), else ``None``s."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id, os.environ.get("LOCAL_WORLD_SIZE") if run_id is not None else None


def torchrun_restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def in_cluster_job() -> bool:
    return "RANK" in os.environ or "SLURM_JOB_ID" in os.environ


def launch_environment() -> dict[str, str]:
    """The environment's variables that say how this process was launched, sorted by name."""
    names = {*RANK_VARIABLES, "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}
    names |= {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}
    prefixes = ("SLURM_", "TORCHELASTIC_", "PET_", "OMPI_", "PMI_", "KUBERNETES_SERVICE_HOST")
    return {k: os.environ[k] for k in sorted(os.environ) if k in names or k.startswith(prefixes)}


def process_name() -> str:
    """``""`` on global rank 0; else ``rank<N>``, or ``node<N>`` for node N's first process started by hand."""
    return f"rank{env_rank()}" if env_rank() else f"node{node_rank()}" if node_rank() else ""


def run_name() -> str:
    """The run directory's name, alike on every process and restart of one job (``launch_id``), else the time's."""
    job = launch_id()
    if job is None and os.environ.get("TORCHELASTIC_RUN_ID") == "none":
        return f"torchrun-{time.strftime('%Y-%m-%d')}-port{os.environ.get('MASTER_PORT')}"
    if job is None:
        return time.strftime("%Y-%m-%d/%H-%M-%S")
    kind, _, name = job.partition(":")
    address, _, port = name.rpartition(":")
    return f"{kind}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{address}-port{port}" if kind == "job" else name)


def launch_id() -> str | None:
    """The launcher's job id, alike on its processes and restarts (``slurm:<id>``), or ``None`` without one."""
    env = os.environ
    if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env:
        return f"slurm:{env['SLURM_JOB_ID']}"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}" if env["TORCHELASTIC_RUN_ID"] != "none" else None
    if "RANK" in env and "MASTER_PORT" in env and not env.get(LAUNCHED_ENV):
        return f"job:{env.get('MASTER_ADDR', 'localhost')}:{env['MASTER_PORT']}"
    return None


def register_resolvers() -> None:
    """``conf/hydra``'s resolvers: the run's name, ``rank_zero:a,b`` (``a`` on rank 0), the log's name and prefix."""
    if not OmegaConf.has_resolver("dpddp.run_name"):
        OmegaConf.register_new_resolver("dpddp.run_name", run_name, use_cache=True)
        OmegaConf.register_new_resolver("dpddp.rank_zero", lambda a, b: b if process_name() else a)
        OmegaConf.register_new_resolver("dpddp.job_name", lambda: process_name() or "train")
        OmegaConf.register_new_resolver("dpddp.rank_tag", lambda: f"[{process_name()}]" if process_name() else "")


def cluster_world_size(cluster: str = "auto") -> tuple[int, str] | None:
    """The world size a cluster launcher started and the variable it came from, or ``None`` outside one."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if cluster == "kubeflow" or ("TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ):
        name = "WORLD_SIZE" if cluster == "kubeflow" else "torchrun WORLD_SIZE"
        return int(os.environ.get("WORLD_SIZE", 1)), name
    if SLURMEnvironment.detect():
        return int(os.environ["SLURM_NTASKS"]), "SLURM_NTASKS"
    return None


LAUNCHED_ENV = "DPDDP_LAUNCHED"  # set in every rank dpddp's own launcher starts
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
NUMBERS: tuple[str, ...] = (*RANK_VARIABLES, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")
NUMBERS += ("TORCHELASTIC_RESTART_COUNT",)


def refuse_non_integer_variables() -> None:
    """Exit 2 with one line when a launcher's number is not an integer (before torch: torchmetrics reads it)."""
    for name in NUMBERS:
        value = os.environ.get(name)
        if value is not None and not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            fix = f"a launcher sets it to a number; unset it (env -u {name} ...) or give it one"
            print(f"error: {name}={value!r} (environment) is not an integer: {fix}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)


def launched() -> bool:
    """Whether torchrun, SLURM or dpddp's launcher started this process."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return launched_by_dpddp() or "TORCHELASTIC_RUN_ID" in os.environ or SLURMEnvironment.detect()


def check_launch_variables(cluster: str, num_nodes: int, ddp: bool) -> None:
    """``ConfigError`` for a run no launcher started: rank variables set, ``cluster=kubeflow`` without a PyTorchJob's,
    or (``ddp``) a ``MASTER_ADDR``/``MASTER_PORT`` that cannot serve its rendezvous."""
    env = os.environ
    if launched():
        return
    missing = [k for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]  # a PyTorchJob's
    stray = [k for k in RANK_VARIABLES if k in env]
    if cluster == "kubeflow" and missing:
        fix = "run inside a PyTorchJob, or drop cluster=kubeflow"
        raise ConfigError(f"cluster=kubeflow but {', '.join(missing)} not set: {fix}")
    if cluster != "kubeflow" and stray and not (stray == ["NODE_RANK"] and num_nodes > 1):
        names = ", ".join(f"{k}={env[k]}" for k in stray)
        no = "but no launcher (torchrun, SLURM, a PyTorchJob with cluster=kubeflow) started this process"
        fix = f"unset {' '.join(stray)} (e.g. env -u {' -u '.join(stray)} python train.py ...)"
        raise ConfigError(f"{names} set in the environment, {no}: {fix}")
    if cluster == "kubeflow" or not ddp:
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if num_nodes > 1 and missing:
        unset = f"num_nodes={num_nodes} without a launcher, but {' and '.join(missing)} not set"
        fix = "set MASTER_ADDR (node 0's address) and MASTER_PORT alike on every node and NODE_RANK on each"
        raise ConfigError(f"{unset}: {fix}, or start the nodes with torchrun")
    address = env.get("MASTER_ADDR")
    another_node = num_nodes > 1 and node_rank() != 0  # which gives node 0's address
    if address is None or another_node or (local := is_local_address(address)):
        return
    what = "does not resolve to an address" if local is None else "is not an address of this machine"
    if num_nodes == 1:
        fix = "unset MASTER_ADDR (env -u MASTER_ADDR python train.py ...), or run under a launcher (torchrun, SLURM)"
        why = f"{what}, but a one-machine run (num_nodes=1) starts every rank here"
        raise ConfigError(f"MASTER_ADDR={address} (environment) {why}: {fix} to use several machines")
    why = f"{what}, but this is node 0 (NODE_RANK unset or 0), which serves the rendezvous"
    fix = "give every node this machine's address as MASTER_ADDR, or set NODE_RANK to this node's rank"
    raise ConfigError(f"MASTER_ADDR={address} (environment) {why}: {fix}")
