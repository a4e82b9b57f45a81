"""One start of a run's ranks agrees on a key prefix of its own (``dpddp/<name>/``) in torchrun's agent store,
which outlives it (docs/design-notes.md, parallel.rendezvous)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

from dpddp._compat import agent_store
from dpddp.cluster import master_address, torchrun_restart_count
from dpddp.errors import RankFailed
from dpddp.parallel.peers import describe_ranks

__all__ = ["START_KEY", "join_start", "torchrun_restarted"]

log = logging.getLogger(__name__)

START_KEY = "dpddp/start"  # where rank 0 of the latest start writes its name

_POLL_S = 0.05


def _key(name: str, *parts: str) -> str:
    return "/".join(["dpddp", name, *parts])


def join_start(store: Any, rank: int, world_size: int, ranks_per_node: int, timeout_s: float) -> str:
    """A fresh key prefix in ``store`` agreed with this start's other ranks, e.g. ``"dpddp/3f2a.../"``. Raises
    ``RankFailed`` naming the nodes and ranks that did not join within ``timeout_s`` seconds."""
    if rank == 0:
        return _lead(store, world_size, ranks_per_node, timeout_s)
    token = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    joined: str | None = None
    while time.monotonic() < deadline:
        name = store.get(START_KEY).decode() if store.check([START_KEY]) else None
        if name is not None and name != joined:
            store.set(_key(name, "join", str(rank)), token)
            joined = name
        if joined is not None and store.check([m := _key(joined, "members")]) and token in json.loads(store.get(m)):
            return _key(joined, "")
        time.sleep(_POLL_S)
    what = describe_ranks([0], ranks_per_node)
    raise RankFailed(f"{what} lost: this start was not joined by rank 0 within {timeout_s:.0f} s; ending the run")


def _lead(store: Any, world_size: int, ranks_per_node: int, timeout_s: float) -> str:
    """Rank 0's part: name this start, wait for every other rank's token, list them."""
    name = uuid.uuid4().hex
    store.set(START_KEY, name)
    deadline = time.monotonic() + timeout_s
    pending = list(range(1, world_size))
    while pending := [r for r in pending if not store.check([_key(name, "join", str(r))])]:
        if time.monotonic() > deadline:
            what = describe_ranks(pending, ranks_per_node)
            raise RankFailed(f"{what} lost: not started within {timeout_s:.0f} s; ending the run")
        time.sleep(_POLL_S)
    tokens = [store.get(_key(name, "join", str(r))).decode() for r in range(1, world_size)]
    store.set(_key(name, "members"), json.dumps(tokens))
    return _key(name, "")


def torchrun_restarted() -> bool:
    """Whether this worker belongs to a restart of its torchrun job (a restart count, or an earlier start in the
    agent's store); ``False`` outside torchrun or if the store does not answer within 10 s."""
    if torchrun_restart_count() > 0:
        return True
    address, port = master_address()
    if address is None or port is None:
        return False
    try:
        store = agent_store(address, int(port), timedelta(seconds=10))
        return store is not None and store.check([START_KEY])
    except RuntimeError as err:  # unreachable: setting up the process group says why (apply_interface), later
        log.debug(f"could not ask torchrun's agent store for an earlier start: {err}")
        return False
