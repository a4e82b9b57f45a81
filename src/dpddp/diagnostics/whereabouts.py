"""Each rank's whereabouts (stage, step, collective) in the rendezvous store: who missed a failed collective."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dpddp.parallel.peers import BEAT_S, StoreClient

log = logging.getLogger(__name__)

AGREEMENT = "the stop agreement"
GRADIENTS = "the gradient all-reduce"
BATCHNORM = "BatchNorm's sums"
METRIC_SYNC = "a metric's sync"

_STAGES = {"train": "training", "sanity_check": "the sanity check", "validate": "validation", "test": "testing"}

_current: str | None = None  # the collective this process is in (or last failed in), or None


def mark(collective: str | None) -> None:
    """Say that this process is now in ``collective`` (``None``: in none)."""
    global _current
    _current = collective


@contextmanager
def entering(collective: str) -> Iterator[None]:
    """Mark ``collective`` for the block; a block that raises leaves it marked (where this process failed)."""
    outer = _current
    mark(collective)
    yield
    mark(outer)


def current() -> str | None:
    """The collective marked now (``mark``), or ``None``."""
    return _current


def describe(rank: int, mine: tuple[str, int, str], others: dict[int, tuple[str, int, str] | None]) -> str | None:
    """The line for ``rank`` failed in ``mine``, given the others' (``None``: unpublished); ``None``: all there."""
    stage, step, collective = mine
    waiting = [rank] + [r for r, where in others.items() if where == mine]
    absent = {r: where for r, where in others.items() if where != mine}
    if not absent:
        return None
    places = "; ".join(f"rank {r} {_place(where)}" for r, where in sorted(absent.items()))
    who, waited = (f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))}" for r in (absent, waiting))
    at = f"{_STAGES.get(stage, stage)}, step {step}"
    return f"{who} did not reach {collective} ({at}): {places} ({waited} waited in it)"


def _place(where: tuple[str, int, str] | None) -> str:
    if where is None:
        return "published no whereabouts"
    stage, step, collective = where
    inside = f"in {collective}" if collective else "outside any collective"
    return f"is in {_STAGES.get(stage, stage)}, step {step}, {inside}"


class Whereabouts(threading.Thread):
    """Publishes ``here()`` to the store at ``address:port`` every ``BEAT_S``; ``explain`` reads the others'."""

    def __init__(
        self, address: str, port: int, rank: int, world_size: int, prefix: str, position: Callable[[], tuple[str, int]]
    ) -> None:
        super().__init__(daemon=True, name="dpddp-whereabouts")
        self.rank, self.world_size, self.prefix, self.position = rank, world_size, prefix, position
        self.stopped = threading.Event()
        self._client = StoreClient(address, port)
        self._published = ""
        mark(None)  # a collective an earlier job of this process failed in is not this job's

    def here(self) -> tuple[str, int, str]:
        return (*self.position(), current() or "")

    def run(self) -> None:
        while not self.stopped.wait(BEAT_S):
            try:
                with self._client.lock:
                    text = "|".join(map(str, self.here()))
                    if text != self._published:
                        self._client.connect().set(f"{self.prefix}where/{self.rank}", text)
                        self._published = text
            except Exception as err:  # the store (rank 0) may be gone: the run is failing already
                log.debug(f"could not publish this rank's whereabouts: {err}")

    def stop(self) -> None:
        self.stopped.set()

    def explain(self) -> str | None:
        """``describe``'s line for the collective this rank failed in, or ``None`` (none, or the store is silent)."""
        mine = self.here()
        if not mine[2]:
            return None
        others: dict[int, tuple[str, int, str] | None] = {}

        def read(store: torch.distributed.Store) -> None:
            for r in sorted(set(range(self.world_size)) - {self.rank}):
                key = f"{self.prefix}where/{r}"
                found = store.get(key).decode().split("|", 2) if store.check([key]) else None
                others[r] = (found[0], int(found[1]), found[2]) if found else None

        answered = self._client.bounded("read the ranks' whereabouts", read)
        return describe(self.rank, mine, others) if answered else None
