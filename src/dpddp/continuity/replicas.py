"""ddp's ranks hold bit-identical weights and optimizer state, or the run ends before a checkpoint of them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from typing_extensions import override

from dpddp.diagnostics.whereabouts import entering
from dpddp.errors import ReplicasDiverged, checked_int

_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_every(cfg: Mapping) -> int | None:
    """``check_replicas`` (optimizer steps), ``None`` when off. Raises ``ConfigError``: not null or positive."""
    every = cfg.get("check_replicas")
    if every is not None:
        checked_int("check_replicas", every, 1, "use a positive number of optimizer steps, or null (off)")
    return every


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the elements' bit patterns as int64: any one changed element changes it."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_AS_INT.get(flat.element_size(), torch.uint8)).sum(dtype=torch.int64)


def checksums(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[list[str], torch.Tensor]:
    """Names and ``[n]`` int64 checksums of ``module``'s parameters, then of the optimizers' state tensors."""
    named = {id(p): n for n, p in module.named_parameters()}
    names, sums = list(named.values()), [_checksum(p) for p in module.parameters()]
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        names.append(f"optimizer {i} {key} of {named.get(id(param), '?')}")
                        sums.append(_checksum(value).to(sums[0].device if sums else value.device))
    return names, torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def divergent(table: list[list[int]]) -> tuple[int, int] | None:
    """``(rank, column)``: the first column where ranks (rows) differ, the first rank off its majority; or ``None``."""
    for column, values in enumerate(zip(*table, strict=True)):
        counts = Counter(values)
        right = max(values, key=lambda v: (counts[v], v == values[0]))
        if len(counts) > 1:
            return next(rank for rank, v in enumerate(values) if v != right), column
    return None


class ReplicaGuard(pl.Callback):
    """Compares the ranks' ``checksums`` every ``every_n_steps`` steps and before every checkpoint (``check``)."""

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
        """Compare the ranks' checksums now (a collective)."""
        if trainer.world_size < 2:
            return
        self._checked_step = trainer.global_step
        names, sums = checksums(trainer.lightning_module, trainer.optimizers)
        sums = sums.to(trainer.strategy.root_device)
        gathered = [torch.empty_like(sums) for _ in range(trainer.world_size)]
        with entering("the replica check"):
            torch.distributed.all_gather(gathered, sums)
        found = divergent([row.tolist() for row in gathered])
        if found is not None:
            at = f"at step {trainer.global_step}, first in {names[found[1]]}"
            why = "a fault on that rank's device, a non-deterministic kernel, or code that changes one rank's weights"
            kept = "no checkpoint is written from it (last.ckpt holds the last agreed weights)"
            raise ReplicasDiverged(f"rank {found[0]}'s replica differs from the others' {at}: {why}; {kept}")
