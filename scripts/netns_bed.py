"""A test bed of N "nodes" on one Linux machine: network namespaces joined by a bridge, as root.

    sudo python scripts/netns_bed.py --nodes 2 -- torchrun --nnodes=2 --node_rank={node_rank} \\
        --nproc_per_node=1 --master_addr={master_addr} --master_port=29555 train.py ...

Node ``i`` is the namespace ``dpddp-<random>-<i>`` with the interface ``dpddp0`` at ``198.18.0.<i+1>/24``
(198.18.0.0/15 is reserved for benchmarking, RFC 2544) and its loopback up; the nodes' veth peers hang on the
bridge ``br0`` in a hub namespace ``dpddp-<random>-hub``, so nothing is created in the machine's own namespace
and no traffic can leave the bed. Every namespace is removed on exit, and the processes left in it killed,
even on an error or Ctrl-C. The command runs once per node (via ``ip netns exec``) with ``{node_rank}``,
``{master_addr}`` (node 0's address), ``{address}`` (the node's own), ``{nodes}`` and ``{ns}`` filled in; the
output is streamed with a ``[node<i>]`` prefix; the exit status is the first non-zero one of the nodes (128 + N
for a node killed by signal N).

``tests/netns.py`` imports this module for the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

IFNAME = "dpddp0"
"""The bed's interface in every node namespace (interface names are per namespace, so all nodes share it)."""


def node_address(index: int) -> str:
    """Node ``index``'s address (0-based): ``198.18.0.<index + 1>``."""
    return f"198.18.0.{index + 1}"


@dataclass
class Bed:
    """The namespaces of a bed: ``nodes[i]`` is node i's, ``addresses[i]`` its address on ``IFNAME``."""

    hub: str
    nodes: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    @property
    def master_addr(self) -> str:
        return self.addresses[0]


def _ip(*args: str) -> None:
    """Run ``ip ARGS``; raise ``RuntimeError`` with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or f'exit status {proc.returncode}'}")


def netns_available() -> str | None:
    """Why a bed cannot be built here (a pytest skip reason), or ``None`` when it can: not root, no ``ip`` or
    ``ss`` command, or ``ip netns add`` / a veth pair / a bridge fails (e.g. in an unprivileged container)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (iproute2)"
    try:
        with netns_bed(1):
            pass
    except RuntimeError as err:
        return f"cannot build a network-namespace bed: {err}"
    return None


def build(nodes: int, prefix: str | None = None) -> Bed:
    """Create a bed of ``nodes`` namespaces (1 to 254). On any failure, what was made is removed and
    ``RuntimeError`` raised. Call ``remove(bed)`` when done (or use ``netns_bed``)."""
    if not 1 <= nodes <= 254:
        raise ValueError(f"nodes={nodes}: use 1 to 254")
    prefix = prefix or f"dpddp-{uuid.uuid4().hex[:6]}"
    bed = Bed(hub=f"{prefix}-hub")
    _ip("netns", "add", bed.hub)  # before the try: a name that exists already is not ours to remove
    try:
        _ip("-n", bed.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", bed.hub, "link", "set", "br0", "up")
        for i in range(nodes):
            ns, address = f"{prefix}-{i}", node_address(i)
            _ip("netns", "add", ns)
            bed.nodes.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", bed.hub, "link", "add", f"n{i}", "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("-n", bed.hub, "link", "set", f"n{i}", "master", "br0")
            _ip("-n", bed.hub, "link", "set", f"n{i}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            bed.addresses.append(address)
    except BaseException:
        remove(bed)
        raise
    return bed


def pids_in(ns: str) -> list[int]:
    """The pids of the processes in namespace ``ns`` (``ip netns pids``)."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()]


def remove(bed: Bed) -> None:
    """Kill the processes left in the bed's namespaces (SIGKILL, by pid) and delete the namespaces, which
    deletes their veths and the bridge. Never raises; what it cannot remove is printed to stderr."""
    for ns in [*bed.nodes, bed.hub]:
        for pid in pids_in(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        if proc.returncode and "No such file" not in proc.stderr:
            print(f"netns_bed: could not delete {ns}: {proc.stderr.strip()}", file=sys.stderr)


@contextmanager
def netns_bed(nodes: int) -> Iterator[Bed]:
    """``with netns_bed(2) as bed: ...``: a bed, removed on exit whatever happens."""
    bed = build(nodes)
    try:
        yield bed
    finally:
        remove(bed)


def run_in(ns: str, cmd: Sequence[str], env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    """Start ``cmd`` in namespace ``ns`` (``ip netns exec``; ``env`` is its whole environment, default ours)
    in a session of its own; ``popen`` goes to ``subprocess.Popen`` (e.g. ``stdout=subprocess.PIPE``)."""
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, start_new_session=True, **popen)


@dataclass
class Listener:
    """A listening TCP socket: its local address (``0.0.0.0``, ``::``, or an address) and port, and its owners
    as ``(command name, pid)``."""

    address: str
    port: int
    owners: list[tuple[str, int]]

    @property
    def wildcard(self) -> bool:
        return self.address in ("0.0.0.0", "::", "*")


def listening(ns: str) -> list[Listener]:
    """The listening TCP sockets in namespace ``ns`` (``ss -ltnpH`` run inside it)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        address = address.strip("[]").split("%")[0]
        owners = []
        for part in line.partition("users:")[2].split("),("):
            name, _, rest = part.strip("()").partition(",pid=")
            if rest:
                owners.append((name.strip('"'), int(rest.split(",")[0])))
        found.append(Listener(address, int(port), owners))
    return found


def fill(cmd: Sequence[str], bed: Bed, index: int) -> list[str]:
    """``cmd`` for node ``index``: its placeholders replaced (only these, so other braces pass unchanged)."""
    values = {
        "{node_rank}": str(index),
        "{master_addr}": bed.master_addr,
        "{address}": bed.addresses[index],
        "{nodes}": str(len(bed.nodes)),
        "{ns}": bed.nodes[index],
    }
    out = []
    for arg in cmd:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def _stream(proc: subprocess.Popen, tag: str) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"{tag} {line}")
        sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="number of namespaces (default 2)")
    parser.add_argument("--timeout", type=float, default=None, help="kill every node after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, with placeholders")
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("no command: netns_bed.py --nodes 2 -- CMD {node_rank} {master_addr} ...")
    if (reason := netns_available()) is not None:
        print(f"netns_bed: {reason}", file=sys.stderr)
        return 2
    with netns_bed(args.nodes) as bed:
        procs, threads = [], []
        for i, ns in enumerate(bed.nodes):
            proc = run_in(ns, fill(cmd, bed, i), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(proc)
            threads.append(threading.Thread(target=_stream, args=(proc, f"[node{i}]"), daemon=True))
            threads[-1].start()
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if deadline is not None and time.monotonic() > deadline:
                print(f"netns_bed: {args.timeout:g} s timeout; killing every node", file=sys.stderr)
                break
            time.sleep(0.2)
        # `remove` kills what is left in the namespaces when the `with` ends
    for thread in threads:
        thread.join(timeout=5)
    codes = [p.wait() for p in procs]
    print(f"netns_bed: exit statuses {codes}", file=sys.stderr)
    code = next((c for c in codes if c), 0)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
