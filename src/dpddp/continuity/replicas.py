"""The replica-consistency guard: ddp's ranks hold bit-identical weights and optimizer state, or the run ends
before a checkpoint of a divergent replica is written (``ReplicaGuard``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from typing_extensions import override

from dpddp.errors import ReplicasDiverged, checked_int
from dpddp.parallel.whereabouts import entering

__all__ = ["ReplicaGuard", "check_every", "checksums", "divergent"]

_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_every(cfg: Mapping) -> int | None:
    """``check_replicas`` (optimizer steps), ``None`` when off.

    Raises:
        ConfigError: not ``null`` or a positive integer.
    """
    every = cfg.get("check_replicas")
    if every is not None:
        checked_int("check_replicas", every, 1, "use a positive number of optimizer steps, or null (off)")
    return every


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the elements' bit patterns as integers (int64, wrapping): any one changed element changes it."""
    flat = tensor.detach().contiguous().reshape(-1)
    kind = _AS_INT.get(flat.element_size())
    bits = flat.view(kind) if kind is not None else flat.view(torch.uint8)
    return bits.sum(dtype=torch.int64)


def checksums(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[list[str], torch.Tensor]:
    """The names and checksums (``[n]`` int64, on the parameters' device) of ``module``'s parameters, then of each
    optimizer's tensors of state, per parameter (``linear.weight``, ``optimizer 0 exp_avg of linear.weight``)."""
    names, sums = [], []
    named = {id(p): n for n, p in module.named_parameters()}
    for name, param in module.named_parameters():
        names.append(name)
        sums.append(_checksum(param))
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        names.append(f"optimizer {i} {key} of {named.get(id(param), '?')}")
                        sums.append(_checksum(value).to(sums[0].device if sums else value.device))
    return names, torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def divergent(table: list[list[int]]) -> tuple[int, int] | None:
    """In ``table`` (a row of checksums per rank), the first column where the ranks differ and the first rank
    whose value there is not the majority's (a tie: rank 0's value is taken as right), as ``(rank, column)``;
    ``None`` when every rank agrees."""
    for column in range(len(table[0]) if table else 0):
        values = [row[column] for row in table]
        counts = Counter(values)
        if len(counts) == 1:
            continue
        most = max(counts.values())
        right = values[0] if counts[values[0]] == most else next(v for v in values if counts[v] == most)
        return next(rank for rank, v in enumerate(values) if v != right), column
    return None


class ReplicaGuard(pl.Callback):
    """Every ``every_n_steps`` optimizer steps of a fit (``global_step`` passing a multiple of it), and before
    every checkpoint (``check``, called by the resumable state), each rank checksums its parameters and optimizer
    state and one ``all_gather`` of the ``[n]`` int64 checksums compares them. Nothing without a process group of
    more than one rank.

    Raises ``ReplicasDiverged`` on every rank: a rank differs (the line names it, the step and the first tensor).
    """

    def __init__(self, every_n_steps: int | None) -> None:
        self.every_n_steps = every_n_steps
        self._checked_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._checked_step = trainer.global_step  # a resumed fit: the next multiple passed, as a straight one

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        every, step = self.every_n_steps, trainer.global_step
        if every and step // every > self._checked_step // every:
            self.check(trainer)

    def check(self, trainer: pl.Trainer) -> None:
        """Compare the ranks' checksums now (a collective: every rank calls it at the same point)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        world = torch.distributed.get_world_size()
        if world < 2:
            return
        self._checked_step = trainer.global_step
        names, sums = checksums(trainer.lightning_module, trainer.optimizers)
        sums = sums.to(trainer.strategy.root_device)
        gathered = [torch.empty_like(sums) for _ in range(world)]
        with entering("the replica check"):
            torch.distributed.all_gather(gathered, sums)
        found = divergent([row.tolist() for row in gathered])
        if found is not None:
            rank, column = found
            raise ReplicasDiverged(
                f"rank {rank}'s replica differs from the others' at step {trainer.global_step}, first in "
                f"{names[column]}: a fault on that rank's device, a non-deterministic kernel, or code that changes "
                "one rank's weights; no checkpoint is written from it (last.ckpt holds the last agreed weights)"
            )
