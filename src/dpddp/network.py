"""Which local network interface the ranks of a multi-node run should use to reach each other (stdlib only).

gloo picks the address it listens on and announces to its peers from the machine's hostname unless
``GLOO_SOCKET_IFNAME`` names an interface; where the hostname resolves to a loopback address (``127.0.0.1`` or
Debian's ``127.0.1.1``), the other nodes are told to connect to their own loopback and the run fails. NCCL has
``NCCL_SOCKET_IFNAME`` for the same purpose. ``choose_interface`` sets both to the interface the kernel would use
to reach ``MASTER_ADDR`` (the one every node already reaches rank 0's store through), unless the user set one.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping

__all__ = ["IFNAME_VARS", "choose_interface", "interface_address", "interface_for_address", "route_interface"]

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables ``choose_interface`` sets; a user's value of either one leaves both untouched."""

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's (primary) IPv4 address
_IF_INET6 = "/proc/net/if_inet6"  # Linux: one line per IPv6 address: hex address, index, prefix, scope, flags, name


def interface_address(name: str) -> str | None:
    """The primary IPv4 address of the interface ``name`` (e.g. ``"198.18.0.2"``), or ``None`` if it has none,
    does not exist, or the platform has no ``SIOCGIFADDR`` ioctl (Linux ``netdevice(7)``). Secondary addresses
    (``ip addr add`` of a second address) are not seen."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (family, port, addr)


def _ipv6_interface(address: ipaddress.IPv6Address) -> str | None:
    """The interface holding the IPv6 ``address``, from Linux's ``/proc/net/if_inet6``; ``None`` elsewhere."""
    try:
        with open(_IF_INET6) as table:
            for line in table:
                fields = line.split()
                if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == address:
                    return fields[5]
    except (OSError, ValueError):
        return None
    return None


def interface_for_address(address: str) -> str | None:
    """The name of the local interface that holds ``address`` (an IP literal; an IPv6 one may carry a
    ``%scope``), or ``None`` when no interface holds it. IPv4 is looked up with ``SIOCGIFADDR`` on every interface
    of ``socket.if_nameindex()``; IPv6 with the scope id, else in ``/proc/net/if_inet6`` (Linux only)."""
    host, _, scope = address.partition("%")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6:
        if scope:
            try:
                return socket.if_indextoname(int(scope)) if scope.isdigit() else scope
            except OSError:
                return None
        return _ipv6_interface(ip)
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if interface_address(name) == str(ip)), None)


def route_interface(address: str, port: int = 9) -> tuple[str, str] | None:
    """The local interface, and its address, through which this machine reaches ``address`` (a host name or an
    IP literal), e.g. ``("eth1", "10.1.2.3")``; ``("lo", "127.0.0.1")`` for a loopback address.

    The kernel's own choice: a UDP socket is ``connect()``-ed to ``(address, port)`` (which only selects a
    route and a source address, sending no packet) and the source address from ``getsockname()`` is mapped to an
    interface with ``interface_for_address``. A host name is resolved with ``getaddrinfo`` (``/etc/hosts``,
    then DNS), the first IPv4 or IPv6 answer that routes being used.

    Returns:
        ``None`` when the name does not resolve, no route leads to it (``ENETUNREACH``), or no interface holds
        the source address (e.g. an IPv4 address that is not an interface's primary one). Never raises
        ``OSError``.
    """
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                local = sock.getsockname()
        except OSError:
            continue
        source = local[0]
        if family == socket.AF_INET6 and local[3]:  # link-local: the scope id is the interface index
            source = f"{source.split('%')[0]}%{local[3]}"
        name = interface_for_address(source)
        if name is not None:
            return name, source.split("%")[0]
    return None


def choose_interface(master_addr: str, environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The socket-interface variables to set for a run whose rank 0 is at ``master_addr``, and one line saying
    why, for the log.

    Rule: when ``environ`` (default ``os.environ``) sets ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` (even
    only one of them), nothing is set: the user's choice wins, and we do not second-guess the other variable.
    Otherwise both are set to the interface ``route_interface(master_addr)`` finds: ``GLOO_SOCKET_IFNAME=<name>``
    and ``NCCL_SOCKET_IFNAME==<name>`` (NCCL reads its value as name prefixes; a leading ``=`` means the exact
    name). When no interface is found, nothing is set and gloo falls back to the hostname's address.

    Returns:
        ``({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"},
        "GLOO_SOCKET_IFNAME=eth1 (routes to MASTER_ADDR=10.0.0.1 from 10.0.0.2)")``, or
        ``({}, "GLOO_SOCKET_IFNAME=eth1 set by the user")``, or ``({}, "no interface routes to ...")``.
    """
    env = os.environ if environ is None else environ
    given = [f"{var}={env[var]}" for var in IFNAME_VARS if env.get(var)]
    if given:
        return {}, f"{' '.join(given)} set by the user"
    found = route_interface(master_addr)
    if found is None:
        return {}, (
            f"no local interface routes to MASTER_ADDR={master_addr}; GLOO_SOCKET_IFNAME left unset (gloo uses the "
            "address of this machine's hostname)"
        )
    name, source = found
    return (
        {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"},
        f"GLOO_SOCKET_IFNAME={name} (routes to MASTER_ADDR={master_addr} from {source})",
    )
