"""``dpddp.parallel.peers.join_start``: the ranks of one start agree on a fresh key prefix in a store that
outlives starts (torchrun's agent store), also when a restarted rank reads the previous start's name first. In
one process: each rank is a thread with its own client of a real TCPStore."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from dpddp._compat import AGENT_STORE_ENV
from dpddp.errors import RankFailed
from dpddp.parallel import peers
from dpddp.parallel.peers import START_KEY, join_start, torchrun_restarted


@pytest.fixture
def store():
    return torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )


def client(store) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))


def start(store, world_size: int, delays: dict[int, float] | None = None, ranks_per_node: int = 1) -> list[str]:
    """Every rank of one start joins (rank r after ``delays[r]`` seconds); their prefixes, by rank."""

    def rank(r: int) -> str:
        time.sleep((delays or {}).get(r, 0.0))
        return join_start(client(store), r, world_size, ranks_per_node, timeout_s=10)

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(rank, range(world_size)))


def test_the_ranks_of_a_start_share_one_fresh_prefix(store):
    prefixes = start(store, 4)
    assert len(set(prefixes)) == 1 and prefixes[0].startswith("dpddp/") and prefixes[0].endswith("/")
    assert prefixes[0] == f"dpddp/{store.get(START_KEY).decode()}/"


def test_a_restarted_rank_that_reads_the_old_start_joins_the_new_one(store):
    """The restart bug: the agent's store still holds the failed start's keys when the new workers come up, and
    rank 1 comes up before rank 0 (it reads the old name first)."""
    old = start(store, 2)[0]
    new = start(store, 2, delays={0: 0.5})
    assert new[0] == new[1] != old


def test_the_ranks_missing_from_a_start_are_named(store):
    with pytest.raises(RankFailed, match=r"^node 1 \(rank 1\), node 2 \(rank 2\) lost: not started within 1 s"):
        join_start(client(store), 0, 3, 1, timeout_s=1.0)


def test_a_node_missing_from_a_start_is_named_with_its_ranks(store):
    """2 nodes x 2: rank 1 (node 0) joins, node 1 never comes."""
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(join_start, client(store), 1, 4, 2, 1.5)
        with pytest.raises(RankFailed, match=r"^node 1 \(ranks 2, 3\) lost: not started within 1 s"):
            join_start(client(store), 0, 4, 2, timeout_s=1.0)
        with pytest.raises(RankFailed):  # rank 0 ended, so rank 1 never gets the member list either
            joined.result()


def test_rank_0_missing_is_named(store):
    with pytest.raises(RankFailed, match=r"^node 0 \(rank 0\) lost: this start was not joined by rank 0 within 1 s"):
        join_start(client(store), 1, 2, 1, timeout_s=1.0)


def test_a_restart_is_seen_by_the_count_or_by_an_earlier_start_in_the_agent_store(store, monkeypatch):
    """An agent that restarts healthy workers for a rejoining node does not count it: the earlier start left in
    its store tells them all the same."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv(AGENT_STORE_ENV, "True")
    assert not torchrun_restarted()  # a job's first start
    start(store, 2)
    assert torchrun_restarted()
    monkeypatch.delenv(AGENT_STORE_ENV)  # a store of rank 0's own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): new per start
    assert not torchrun_restarted()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert torchrun_restarted()


def test_an_unreachable_agent_store_is_no_restart(monkeypatch):
    """Where MASTER_ADDR leads nowhere from here, the entry goes on: setting up the process group says why."""
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv(AGENT_STORE_ENV, "True")
    monkeypatch.setattr(peers, "timedelta", lambda seconds: timedelta(seconds=0.5))
    assert not torchrun_restarted()
