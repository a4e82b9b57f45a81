"""Data built in code is the same on every rank: seeded by ``data_streams``, checked by ``SameDataOnEveryRank``."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from dpddp.data.draws import seed_streams, streams_kept
from dpddp.errors import ConfigError
from dpddp.nn import key64

BUILD = 0xB111_DA7A  # folded into the seed first: apart from the samples' keys (draws.STREAMS)


@contextmanager
def data_streams(seed: int) -> Iterator[None]:
    """The block runs with the global (and initialized CUDA) streams seeded from ``key64(BUILD, seed)``, then kept."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), streams_kept():
        key = key64(BUILD, int(seed))
        seed_streams(key)
        if devices:
            torch.cuda.manual_seed_all(key)
        yield


def in_data_streams(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a data module's method) run inside ``data_streams(self.seed)`` (seed 0 without one)."""

    @functools.wraps(hook)
    def seeded(self: Any, *args: Any, **kwargs: Any) -> Any:
        with data_streams(getattr(self, "seed", 0)):
            return hook(self, *args, **kwargs)

    return seeded


def data_checksum(splits: Mapping[str, Any]) -> int:
    """A 63-bit checksum of batch-indexed ``splits``: each one's length and first, middle and last samples."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(splits):
        split = splits[name]
        n = len(split)
        digest.update(f"{name}:{n}".encode())
        for i in sorted({0, n // 2, n - 1}) if n else []:
            apply_to_collection(
                split[torch.tensor([i])],
                torch.Tensor,
                lambda t: digest.update(str(tuple(t.shape)).encode() + t.detach().cpu().contiguous().numpy().tobytes()),
            )
    return int.from_bytes(digest.digest(), "little") >> 1


class SameDataOnEveryRank(pl.Callback):
    """Raises ConfigError at a fit's ``setup`` when the ranks' ``data_checksum`` of the module's ``splits`` differ."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        data = getattr(trainer, "datamodule", None)
        splits = getattr(data, "splits", None)
        if stage != "fit" or trainer.world_size < 2 or not isinstance(splits, Mapping) or not splits:
            return
        mine = torch.tensor(data_checksum(splits), dtype=torch.int64)
        sums = trainer.strategy.all_gather(mine.to(trainer.strategy.root_device)).reshape(-1).tolist()
        if len(set(sums)) > 1:
            raise ConfigError(
                f"data: {type(data).__name__} built different data on the ranks ({len(set(sums))} checksums over "
                f"{len(sums)} ranks): build it without seeding the global streams per rank, or from "
                "torch.Generator().manual_seed(seed)"
            )
