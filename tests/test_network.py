"""``dpddp.diagnostics.network``: the interface routing to MASTER_ADDR, on loopback and across network namespaces."""

import json
import os
import socket
import subprocess
import sys

import pytest
from netns import IFNAME, bed_fixture, run_in

from dpddp.diagnostics import network
from dpddp.diagnostics.network import (
    IFNAME_VARS,
    choose_interface,
    interface_address,
    interface_for_address,
    route_interface,
)
from dpddp.errors import ConfigError
from dpddp.parallel.ddp import apply_interface

bed2 = bed_fixture(2)


def loopback_name() -> str:
    return next(name for _, name in socket.if_nameindex() if interface_address(name) == "127.0.0.1")


def test_route_to_loopback_is_the_loopback_interface():
    assert route_interface("127.0.0.1") == (loopback_name(), "127.0.0.1")
    assert route_interface("localhost") in ((loopback_name(), "127.0.0.1"), None)  # None: localhost is ::1 only


def test_interface_address_and_back():
    name = loopback_name()
    assert interface_address(name) == "127.0.0.1"
    assert interface_for_address("127.0.0.1") == name
    assert interface_address("no-such-if0") is None
    assert interface_for_address("not an address") is None


def test_unknown_name_or_no_route_gives_none(monkeypatch):
    def no_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with monkeypatch.context() as m:
        m.setattr(network.socket, "getaddrinfo", no_name)
        assert route_interface("no-such-host.invalid") is None

    def unreachable(self, address):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    assert route_interface("198.18.0.1") is None
    assert choose_interface("198.18.0.1", {}) == (
        {},
        "no local interface routes to MASTER_ADDR=198.18.0.1; GLOO_SOCKET_IFNAME left unset "
        "(gloo uses the address of this machine's hostname)",
    )


def test_choose_interface_sets_both_variables():
    env, why = choose_interface("127.0.0.1", {})
    name = loopback_name()
    assert env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}
    assert why == f"GLOO_SOCKET_IFNAME={name} (routes to MASTER_ADDR=127.0.0.1 from 127.0.0.1)"


@pytest.mark.parametrize(
    "given, why",
    [
        ({"GLOO_SOCKET_IFNAME": "eth1"}, "GLOO_SOCKET_IFNAME=eth1 set by the user"),
        ({"NCCL_SOCKET_IFNAME": "ib"}, "NCCL_SOCKET_IFNAME=ib set by the user"),
        (
            {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"},
            "GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME==eth1 set by the user",
        ),
    ],
)
def test_a_users_setting_wins(given, why):
    assert choose_interface("127.0.0.1", given) == ({}, why)


# Loads network.py by its path: it is stdlib only, so the probe starts in milliseconds (no torch, no Lightning).
PROBE = (
    "import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('network', sys.argv[1]); "
    "net = importlib.util.module_from_spec(spec); spec.loader.exec_module(net); "
    "print(json.dumps([net.route_interface(a) for a in sys.argv[2:]] + [net.choose_interface(sys.argv[2], {})]))"
)


def test_route_inside_a_namespace(bed2):
    """Node 1 reaches node 0 (and itself) through the bed's interface; an address outside the bed has no route
    there (the namespace has no default route), so no packet can leave it."""
    cmd = [sys.executable, "-c", PROBE, network.__file__, bed2.addresses[0], bed2.addresses[1], "198.19.0.1"]
    proc = run_in(bed2.nodes[1], cmd, env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    to_master, to_self, outside, (env, why) = json.loads(out)
    assert to_master == [IFNAME, bed2.addresses[1]]
    assert to_self == [IFNAME, bed2.addresses[1]]
    assert outside is None
    assert env == {"GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": f"={IFNAME}"}
    assert why == f"GLOO_SOCKET_IFNAME={IFNAME} (routes to MASTER_ADDR={bed2.addresses[0]} from {bed2.addresses[1]})"


def test_is_local_address_is_whether_a_socket_binds_to_it():
    from dpddp.diagnostics.network import is_local_address

    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert is_local_address("198.18.255.1") is False  # no interface here holds it
    assert is_local_address("x.invalid") is None


def test_a_master_addr_reached_through_loopback_is_refused_for_several_nodes(monkeypatch):
    """``MASTER_ADDR`` a host name that resolves to loopback here (as ``hostname`` -> 127.0.1.1): one line for a
    multi-node run; one node takes it (and the interface); a loopback address itself is one machine's own run."""
    real = socket.getaddrinfo
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda host, *a, **k: real("127.0.0.1" if host == "node0" else host, *a, **k)
    )
    for var in IFNAME_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    name = loopback_name()
    why = f"GLOO_SOCKET_IFNAME={name} (routes to MASTER_ADDR=node0 from 127.0.0.1)"
    with pytest.raises(ConfigError) as err:
        apply_interface("node0", 2)
    assert str(err.value) == (
        f"MASTER_ADDR=node0 is reached through this machine's loopback ({why}), so other nodes cannot reach it: "
        "set MASTER_ADDR (torchrun --master_addr) to node 0's address on the cluster network"
    )
    assert not set(IFNAME_VARS) & set(os.environ)
    assert apply_interface("node0", 1) == why and os.environ["GLOO_SOCKET_IFNAME"] == name
    for var in IFNAME_VARS:
        del os.environ[var]
    assert apply_interface("127.0.0.1", 2) == why.replace("node0", "127.0.0.1")
