"""``dpddp.parallel.peers``: the heartbeats of a multi-node run, in one process against a real TCPStore (each
``PeerWatch`` is a thread with its own client, as each rank's is), with the beat and the bounds made short.
``PeerWatch._end`` (``os._exit(1)`` in a run) records the line and ends the watch instead."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

from dpddp.parallel import peers
from dpddp.parallel.peers import PeerWatch, describe_ranks

TIMEOUT_S = 1.0
BEAT_S = 0.05
SLACK_S = 0.5  # a store round trip and the scheduling of a busy machine


class Watch(PeerWatch):
    """A ``PeerWatch`` whose end is recorded (line, seconds since start) rather than ending the process."""

    def __init__(self, port: int, rank: int, world_size: int = 2, ranks_per_node: int = 1, **kw) -> None:
        super().__init__("127.0.0.1", port, rank, world_size, ranks_per_node, kw.get("timeout_s", TIMEOUT_S), "t/")
        self.started, self.ended, self.line = time.monotonic(), threading.Event(), ""

    def _end(self, line: str) -> None:
        self.line = line
        self.ended.set()
        self.stopped.set()  # the loop ends at its next wait


@pytest.fixture
def store():
    return torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )


@pytest.fixture(autouse=True)
def _short(monkeypatch):
    monkeypatch.setattr(peers, "BEAT_S", BEAT_S)
    monkeypatch.setattr(peers, "STALE_S", 0.5)
    monkeypatch.setattr(peers, "CAUSE_GRACE_S", 0.3)
    monkeypatch.setattr(peers, "_STORE_OP_S", 0.5)


def start(*watches: Watch) -> None:
    for watch in watches:
        watch.start()


def beating(watch: Watch, rank: int) -> None:
    """Wait until ``watch`` has seen ``rank``'s counter move."""
    deadline = time.monotonic() + 5
    while watch._seen[rank][0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch._seen[rank][0] != 0


def test_describe_ranks_groups_by_node():
    assert describe_ranks([1], 1) == "node 1 (rank 1)"
    assert describe_ranks([3, 2], 2) == "node 1 (ranks 2, 3)"
    assert describe_ranks([4, 2], 2) == "node 1 (rank 2), node 2 (rank 4)"


def test_a_peer_gone_silent_is_named_within_the_bound(store):
    """A peer that stops beating without leaving (a stopped process, a cut link) ends the watcher within
    ``timeout_s + BEAT_S`` plus a store round trip, with one line naming its node and rank."""
    watches = [Watch(store.port, r) for r in (0, 1)]
    start(*watches)
    beating(watches[0], 1)
    watches[1].stop(clean=False)
    gone = time.monotonic()
    assert watches[0].ended.wait(TIMEOUT_S + 2)
    seconds = time.monotonic() - gone
    assert TIMEOUT_S - 2 * BEAT_S <= seconds <= TIMEOUT_S + BEAT_S + SLACK_S, seconds
    assert watches[0].line == "node 1 (rank 1) lost: no heartbeat for 1 s"


def test_a_node_that_never_beats_is_named_with_all_its_ranks(store):
    """Node 1 (ranks 2, 3) never starts: ranks 0 and 1 end within the bound of their own start."""
    watches = [Watch(store.port, r, world_size=4, ranks_per_node=2) for r in (0, 1)]
    start(*watches)
    for watch in watches:
        assert watch.ended.wait(TIMEOUT_S + 2)
        assert time.monotonic() - watch.started <= TIMEOUT_S + BEAT_S + SLACK_S
        assert watch.line == "node 1 (ranks 2, 3) lost: no heartbeat for 1 s"


def test_a_clean_stop_is_not_a_loss_and_the_next_watch_beats_again(store):
    first, other = Watch(store.port, 1), Watch(store.port, 0)
    start(first, other)
    beating(other, 1)
    first.stop()  # the end of a stage on rank 1
    first.join()
    assert store.add("t/beat/1", 0) < 0
    assert not other.ended.wait(2 * TIMEOUT_S), other.line  # rank 0 goes on watching: no loss
    assert other.explain() is None
    second = Watch(store.port, 1)  # rank 1's next stage
    second.start()
    deadline = time.monotonic() + 5
    while store.add("t/beat/1", 0) <= 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.add("t/beat/1", 0) > 0
    second.stop(clean=False)  # and now it goes silent: a loss again
    assert other.ended.wait(TIMEOUT_S + 2)
    assert other.line.startswith("node 1 (rank 1) lost")
    second.join()


def test_explain_names_the_silent_peer_with_its_silence(store):
    watches = [Watch(store.port, r, timeout_s=30) for r in (0, 1)]
    start(*watches)
    beating(watches[0], 1)
    assert watches[0].explain() is None  # every peer beats: the failure is this rank's own (after STALE_S + 1 s)
    watches[1].stop(clean=False)
    time.sleep(1.1)
    assert watches[0].explain() == "node 1 (rank 1) lost: no heartbeat for 1 s"
    watches[0].stop()


def test_a_reported_failure_ends_the_peers_after_the_grace(store):
    watches = [Watch(store.port, r, world_size=3, timeout_s=30) for r in range(3)]
    start(*watches)
    beating(watches[0], 2)
    watches[1].report("rank 1 (node 1) failed: ValueError: bad")
    watches[2].report("rank 2 (node 2) failed: later")  # first one wins
    watches[1].stop(clean=False)
    for w in (watches[0], watches[2]):
        assert w.ended.wait(2)
        assert w.line == "rank 1 (node 1) failed: ValueError: bad"
    assert watches[0].explain() == "rank 1 (node 1) failed: ValueError: bad"


class Proxy(threading.Thread):
    """A TCP proxy on 127.0.0.1 to ``port`` that can be frozen: from then on it holds what it receives and
    closes nothing, as a node whose processes are stopped or whose link is down."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.upstream, self.frozen = port, threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]

    def run(self) -> None:
        while True:
            conn, _ = self.server.accept()
            up = socket.create_connection(("127.0.0.1", self.upstream))
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(65536):
            while self.frozen.is_set():
                time.sleep(0.05)
            dst.sendall(data)


def test_a_store_gone_silent_is_node_0_lost_and_holds_no_one(store):
    """Node 0's store stops answering without closing anything (torch's client then waits for ever inside an
    operation): the watch still ends within the bound, and a failing rank's report does not hang on it."""
    proxy = Proxy(store.port)
    proxy.start()
    watch = Watch(proxy.port, 1)
    other = Watch(store.port, 0, timeout_s=30)
    start(watch, other)
    beating(watch, 0)
    proxy.frozen.set()
    gone = time.monotonic()
    assert watch.ended.wait(TIMEOUT_S + 2)
    assert time.monotonic() - gone <= TIMEOUT_S + 2 * BEAT_S + SLACK_S
    assert watch.line == f"node 0 lost: the rendezvous store at 127.0.0.1:{proxy.port} has not answered for 1 s"
    begun = time.monotonic()
    watch.report("rank 1 (node 1) failed: x")
    watch.stop()
    assert time.monotonic() - begun <= 2 * 2 * peers._STORE_OP_S + SLACK_S
    other.stop()


def test_a_watch_stopped_before_its_first_beat_returns_at_once(store, monkeypatch):
    """A stage shorter than one beat: ``stop`` has no client to tell the peers through and returns at once, not
    after the store bound (each stage's teardown of a short multi-node run waited it out, 10 s)."""
    monkeypatch.setattr(peers, "_STORE_OP_S", 5.0)
    monkeypatch.setattr(peers, "BEAT_S", 60.0)
    watch = Watch(store.port, 0)
    watch.start()
    began = time.monotonic()
    watch.stop()
    assert time.monotonic() - began < 2.0
    assert not store.check(["t/beat/0"])


def test_a_store_that_never_answers_is_node_0_lost():
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    watch = Watch(port, 1)
    watch.start()
    assert watch.ended.wait(TIMEOUT_S + 3 * 2 * peers._STORE_OP_S + SLACK_S)  # a try to connect takes ~2 x that
    assert watch.line.startswith(f"node 0 lost: the rendezvous store at 127.0.0.1:{port} has not answered for 1 s")
