"""When and how a loop's ranks agree on a SIGTERM (``dpddp.continuity.stop.StepBoundaryStop``)."""

from __future__ import annotations

import time

import torch

from dpddp.diagnostics.whereabouts import AGREEMENT, entering


class Pace:
    """Every ``every`` batches (1 to 1000, from the slowest rank's batch time): about ``interval_s`` apart."""

    def __init__(self) -> None:
        self.every, self.batches, self.since = 1, 0, time.perf_counter()

    def due(self) -> bool:
        self.batches += 1
        return self.batches >= self.every

    def batch_s(self) -> float:
        return (time.perf_counter() - self.since) / max(self.batches, 1)

    def agreed(self, interval_s: float, batch_s: float) -> None:
        self.every = int(min(max(interval_s / max(batch_s, 1e-9), 1), 1000))
        self.batches, self.since = 0, time.perf_counter()


def agreed(flag: int, device: torch.device, pace: Pace | None, interval_s: float) -> int:
    """The ranks' largest ``flag`` (one ``all_reduce(MAX)``; ``flag`` without a group); with ``pace``, the slowest
    rank's batch time sets its next due batch."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return int(flag)
    batch_s = pace.batch_s() if pace is not None else 0.0
    flags = torch.tensor([float(flag), batch_s], dtype=torch.float64).to(device)
    with entering(AGREEMENT):
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    reduced, batch_s = flags.tolist()
    if pace is not None:
        pace.agreed(interval_s, batch_s)
    return int(reduced)
