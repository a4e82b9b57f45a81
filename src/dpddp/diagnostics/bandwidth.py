"""All-reduce latency and bus bandwidth between ranks, and the ring cost they predict (``dpddp-check --network``)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.queues import SimpleQueue

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from dpddp.diagnostics.network import choose_interface

BIG_BYTES = 32 * 2**20  # the buffer whose all-reduce sets the bus bandwidth (latency a small part)


@dataclass(frozen=True)
class Collective:
    """What ``_in_group`` found: ``latency_s`` of one float32's all-reduce, ``times``: bytes -> seconds (medians)."""

    world_size: int
    backend: str
    latency_s: float
    times: dict[int, float]


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests' ``busbw``: ``2(N-1)/N x nbytes / seconds``. Raises ``ValueError`` for ``world_size < 2``."""
    if world_size < 2:
        raise ValueError(f"an all-reduce over {world_size} rank moves nothing")
    return 2 * (world_size - 1) / world_size * nbytes / max(seconds, 1e-9)


def ring_seconds(nbytes: int, world_size: int, latency_s: float, bus_bytes_per_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes``: ``latency_s + 2(N-1)/N x nbytes / bus_bytes_per_s``."""
    return latency_s + 2 * (world_size - 1) / world_size * nbytes / bus_bytes_per_s


def _median_seconds(tensor: torch.Tensor) -> float:
    def once() -> None:
        dist.all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    median = step_seconds(once, before=dist.barrier)
    slowest = torch.tensor([median], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank's does
    return float(slowest.item())


def _in_group(rank: int, world_size: int, device: torch.device, sizes: list[int]) -> Collective:
    """The slowest rank's median seconds of float32 all-reduces of one float and of ``sizes`` bytes on ``device``,
    in a process group this rank starts and ends (NCCL on a GPU, else gloo)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        latency = _median_seconds(torch.zeros(1, device=device))
        times = {n: _median_seconds(torch.zeros(max(n // 4, 1), device=device)) for n in sorted(set(sizes))}
        return Collective(world_size, backend, latency, times)
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, port: int, sizes: list[int], out: SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if torch.cuda.device_count() >= world else torch.device("cpu")
    found = _in_group(rank, world, device, sizes)
    if rank == 0:
        out.put(found)


def measure_ranks(processes: int, sizes: list[int]) -> Collective | None:
    """``_in_group`` between torchrun's or SLURM's ranks (``None`` on all but rank 0), else between ``processes``
    spawned here (loopback; NCCL with a GPU each). Raises ``ProcessRaisedException`` when a spawned rank raised."""
    env = next((e for e in (TorchElasticEnvironment, SLURMEnvironment) if e.detect()), None)
    if env is None:
        out = torch.multiprocessing.get_context("spawn").SimpleQueue()
        port = find_free_network_port()
        torch.multiprocessing.start_processes(
            _spawned_rank, args=(processes, port, sizes, out), nprocs=processes, start_method="spawn"
        )
        return out.get()
    cluster = env()
    updates, _ = choose_interface(cluster.main_address)
    os.environ.update(updates, MASTER_ADDR=cluster.main_address, MASTER_PORT=str(cluster.main_port))
    device = torch.device("cuda", cluster.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    found = _in_group(cluster.global_rank(), cluster.world_size(), device, sizes)
    return found if cluster.global_rank() == 0 else None


def recommend(share: float, compressible: bool) -> str:
    """The advice for an all-reduce ``share`` (0-1) of a ddp step; ``compressible``: a comm hook may help."""
    if share < 0.2:
        return "ddp: the all-reduce is a small part of each step; more processes train faster"
    if share < 0.5:
        fix = "compress the gradients (a bf16/fp16 comm hook) or " if compressible else ""
        return f"ddp, with care: {fix}raise the per-device batch so that each step computes more per byte sent"
    return "one process (or dp over this machine's GPUs): the network would take most of each ddp step"


def step_seconds(step: Callable[[], None], reps: int = 10, before: Callable[[], object] = lambda: None) -> float:
    """The median seconds of ``step()`` after one warm-up call; ``before()`` runs untimed before each."""
    step()
    times = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
