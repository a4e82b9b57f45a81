"""Network-namespace beds for tests: N "nodes" on one machine, joined by a bridge, addresses 198.18.0.<i+1>.

The logic lives in ``scripts/netns_bed.py`` (one place, also runnable by hand); this module loads it and adds a
pytest fixture factory. Use::

    from netns import netns_available, run_in, listening, bed_fixture

    pytestmark = pytest.mark.skipif(netns_available() is not None, reason=str(netns_available()))
    bed2 = bed_fixture(2)

    def test_x(bed2):
        proc = run_in(bed2.nodes[1], [sys.executable, "-c", "..."], env=env, stdout=subprocess.PIPE)
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "netns_bed.py"
_spec = importlib.util.spec_from_file_location("netns_bed", _PATH)
netns_bed_module = importlib.util.module_from_spec(_spec)
sys.modules["netns_bed"] = netns_bed_module  # dataclasses look their module up in sys.modules
_spec.loader.exec_module(netns_bed_module)

IFNAME = netns_bed_module.IFNAME
Bed = netns_bed_module.Bed
Listener = netns_bed_module.Listener
netns_bed = netns_bed_module.netns_bed
run_in = netns_bed_module.run_in
listening = netns_bed_module.listening
pids_in = netns_bed_module.pids_in
node_address = netns_bed_module.node_address

__all__ = ["IFNAME", "Bed", "Listener", "bed_fixture", "listening", "netns_available", "netns_bed", "pids_in", "run_in"]


@functools.cache
def netns_available() -> str | None:
    """Why no bed can be built here (a skip reason), or ``None``; checked once per test process."""
    return netns_bed_module.netns_available()


def bed_fixture(nodes: int) -> Callable[[], Iterator[Bed]]:
    """A pytest fixture giving a fresh bed of ``nodes`` namespaces per test (skipped where none can be built),
    removed after the test, passed or not."""

    @pytest.fixture
    def _bed() -> Iterator[Bed]:
        reason = netns_available()
        if reason is not None:
            pytest.skip(reason)
        with netns_bed(nodes) as bed:
            yield bed

    return _bed
