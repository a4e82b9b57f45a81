"""A start's ranks in the rendezvous store: their key prefix (``join_start``), heartbeats (``PeerWatch``)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from dpddp._compat import agent_store
from dpddp.cluster import master_address, torchrun_restart_count
from dpddp.errors import RankFailed

log = logging.getLogger(__name__)

BEAT_S = 0.5  # seconds between two heartbeats (and reads of the peers')
STALE_S = 3.0  # seconds without a heartbeat after which ``explain`` calls a peer lost (the run has failed then)
CAUSE_GRACE_S = 5.0  # seconds the main thread gets to fail by itself after a peer reported a failure
LEFT = 1 << 40  # taken off the heartbeat counter of a rank that stops cleanly (negative: gone, not lost)
_STORE_OP_S = 5.0  # seconds one store operation may take before it counts as unanswered
START_KEY = "dpddp/start"  # where rank 0 of the latest start writes its name
_POLL_S = 0.05


class StoreClient:
    """A client of the store at ``address:port``, connected on first use, shared by a rank's threads under ``lock``."""

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self.lock = threading.Lock()
        self._store: torch.distributed.Store | None = None

    def connect(self) -> torch.distributed.Store:
        """The client (the caller holds ``lock``). Raises what ``TCPStore`` raises when the store does not answer."""
        if self._store is None:
            self._store = torch.distributed.TCPStore(
                self.address, self.port, is_master=False, timeout=timedelta(seconds=_STORE_OP_S)
            )
        return self._store

    def bounded(self, what: str, op: Callable[[torch.distributed.Store], object], connect: bool = True) -> bool:
        """Whether ``op`` ran on the client (``connect=False``: one already connected) within about ``2 x
        _STORE_OP_S`` seconds, in a helper thread (a silent store never answers). Never raises."""
        ended, ran = threading.Event(), []

        def call() -> None:
            if self.lock.acquire(timeout=_STORE_OP_S):
                try:
                    if connect or self._store is not None:
                        op(self.connect())
                        ran.append(True)
                except Exception as err:
                    log.debug(f"could not {what}: {err}")
                finally:
                    self.lock.release()
            ended.set()

        threading.Thread(target=call, daemon=True, name="dpddp-store-op").start()
        return ended.wait(2 * _STORE_OP_S) and bool(ran)


def describe_ranks(ranks: list[int], ranks_per_node: int) -> str:
    """``"node 1 (rank 1)"``, ``"node 1 (ranks 2, 3)"``, ``"node 1 (rank 2), node 2 (rank 4)"``."""
    by_node: dict[int, list[str]] = {}
    for rank in sorted(ranks):
        by_node.setdefault(rank // ranks_per_node, []).append(str(rank))
    return ", ".join(f"node {n} (rank{'s' * (len(r) > 1)} {', '.join(r)})" for n, r in by_node.items())


class PeerWatch(threading.Thread):
    """Exits this process with status 1 after ``timeout_s`` seconds without a peer's heartbeat or a store answer,
    or ``CAUSE_GRACE_S`` after a peer reported a failure. ``prefix``: this start's keys (``join_start``)."""

    def __init__(
        self, address: str, port: int, rank: int, world_size: int, ranks_per_node: int, timeout_s: float, prefix: str
    ) -> None:
        super().__init__(daemon=True, name="dpddp-peer-watch")
        self.ranks_per_node, self.timeout_s, self.prefix = ranks_per_node, timeout_s, prefix
        self.stopped = threading.Event()
        self._client = StoreClient(address, port)  # shared by the beat thread, `report` and `stop`
        self._own_key = f"{prefix}beat/{rank}"
        now = time.monotonic()
        self._seen = {r: (0, now) for r in range(world_size) if r != rank}  # rank -> (counter, when it changed)
        self._answered = now  # when the store last answered
        self._error = ""  # the last store operation's failure, for the line
        self._cause: str | None = None
        self._cause_seen: float | None = None
        self._left = False  # whether this rank's counter carries -LEFT (set by `stop`, undone by the next watch)

    def stop(self, clean: bool = True) -> None:
        """End the watch (``clean``: tell the peers this rank left, so its silence is not a loss). Never raises."""
        self.stopped.set()
        if clean:
            self._client.bounded("tell the peers that this rank left", self._leave, connect=False)

    def _leave(self, store: torch.distributed.Store) -> None:
        if not self._left:
            store.add(self._own_key, -LEFT)
            self._left = True

    def run(self) -> None:
        threading.Thread(target=self._beat_loop, daemon=True, name="dpddp-peer-beat").start()
        while not self.stopped.wait(BEAT_S):
            if line := self._lost(self.timeout_s, said=self.timeout_s):
                self._end(line)
            elif self._cause is not None:
                self._cause_seen = self._cause_seen or time.monotonic()
                if time.monotonic() - self._cause_seen > CAUSE_GRACE_S:
                    self._end(self._cause)

    def _lost(self, limit: float, said: float | None = None) -> str | None:
        """The line (``said`` s, else the silence) for node 0's store or peers silent over ``limit`` s, or ``None``."""
        now = time.monotonic()
        if now - self._answered > limit:  # then no peer can be seen either
            why = f" ({self._error})" if self._error else ""
            store = f"the rendezvous store at {self._client.address}:{self._client.port}"
            return f"node 0 lost: {store} has not answered for {said or now - self._answered:.0f} s{why}"
        stale = [r for r, (_, t) in self._seen.items() if now - t > limit]
        if not stale:
            return None
        silent = max(now - self._seen[r][1] for r in stale)
        return f"{describe_ranks(stale, self.ranks_per_node)} lost: no heartbeat for {said or silent:.0f} s"

    def _beat_loop(self) -> None:
        while not self.stopped.wait(BEAT_S):
            try:
                self._beat()
            except Exception as err:  # refused, reset or timed out: the store (node 0) may be gone
                self._error = type(err).__name__

    def _beat(self) -> None:
        with self._client.lock:
            store = self._client.connect()
            if self.stopped.is_set():  # `stop` may have run while this beat waited for the lock
                return
            if store.add(self._own_key, 1) < 0:  # an earlier watch of this rank (stage) left
                store.add(self._own_key, LEFT)
            counts = {r: store.add(f"{self.prefix}beat/{r}", 0) for r in self._seen}
            cause_key = f"{self.prefix}cause"
            cause = store.get(cause_key).decode() if store.check([cause_key]) else None
        now = time.monotonic()
        self._answered, self._error = now, ""
        for r, count in counts.items():
            if count != self._seen[r][0] or count < 0:  # moved, or left cleanly
                self._seen[r] = (count, now)
        self._cause = cause

    def _end(self, line: str) -> None:
        log.error(f"error: {line}; ending the run")
        logging.shutdown()
        os._exit(1)

    def explain(self) -> str | None:
        """The peer to blame for the run's failure, or ``None`` if all still beat; blocks up to ``STALE_S + 1`` s."""
        deadline = time.monotonic() + STALE_S + 1.0
        while (line := self._cause or self._lost(STALE_S)) is None:
            if time.monotonic() > deadline or not self.is_alive():
                return None
            time.sleep(0.1)
        return line

    def report(self, line: str) -> None:
        """Tell the peers why this rank is failing (the first report wins). Never raises."""
        key = f"{self.prefix}cause"
        self._client.bounded("report the failure to the store", lambda s: s.compare_set(key, "", line), connect=False)


def join_start(store: Any, rank: int, world_size: int, ranks_per_node: int, timeout_s: float) -> str:
    """A fresh key prefix agreed by this start's ranks in ``store``; ``RankFailed`` naming those not joined in time."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:  # name this start, wait for every other rank's token, list them
        name = uuid.uuid4().hex
        store.set(START_KEY, name)
        pending = list(range(1, world_size))
        while pending := [r for r in pending if not store.check([f"dpddp/{name}/join/{r}"])]:
            if time.monotonic() > deadline:
                what = describe_ranks(pending, ranks_per_node)
                raise RankFailed(f"{what} lost: not started within {timeout_s:.0f} s; ending the run")
            time.sleep(_POLL_S)
        tokens = [store.get(f"dpddp/{name}/join/{r}").decode() for r in range(1, world_size)]
        store.set(f"dpddp/{name}/members", json.dumps(tokens))
        return f"dpddp/{name}/"
    token = uuid.uuid4().hex
    joined: str | None = None
    while time.monotonic() < deadline:
        latest = store.get(START_KEY).decode() if store.check([START_KEY]) else None
        if latest is not None and latest != joined:
            store.set(f"dpddp/{latest}/join/{rank}", token)
            joined = latest
        if joined is not None and store.check([m := f"dpddp/{joined}/members"]) and token in json.loads(store.get(m)):
            return f"dpddp/{joined}/"
        time.sleep(_POLL_S)
    late = f"this start was not joined by rank 0 within {timeout_s:.0f} s"
    raise RankFailed(f"node 0 (rank 0) lost: {late}; ending the run")


def torchrun_restarted() -> bool:
    """Whether this worker belongs to a restart of its torchrun job; ``False`` outside torchrun or if it is silent."""
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
