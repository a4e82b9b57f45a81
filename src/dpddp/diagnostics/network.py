"""The local network interface the ranks of a multi-node run reach each other by (stdlib only)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's (primary) IPv4 address
_IF_INET6 = "/proc/net/if_inet6"  # Linux: one line per IPv6 address: hex address, index, prefix, scope, flags, name


def interface_address(name: str) -> str | None:
    """The primary IPv4 address of interface ``name``, or ``None`` (none, or no such interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (family, port, addr)


def interface_for_address(address: str) -> str | None:
    """The local interface holding ``address`` (an IP literal, IPv6 with an optional ``%scope``), or ``None``."""
    try:
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv4Address):
            return next((n for _, n in socket.if_nameindex() if interface_address(n) == str(ip)), None)
        if ip.scope_id:
            return socket.if_indextoname(int(ip.scope_id)) if ip.scope_id.isdigit() else ip.scope_id
        rows = [line.split() for line in Path(_IF_INET6).read_text().splitlines()]
        return next((f[5] for f in rows if len(f) == 6 and ipaddress.IPv6Address(int(f[0], 16)) == ip), None)
    except (OSError, ValueError):
        return None


def _resolve(address: str, port: int, kind: int) -> list[tuple[Any, ...]] | None:
    try:
        return socket.getaddrinfo(address, port, type=kind)
    except (OSError, UnicodeError):
        return None


def is_local_address(address: str) -> bool | None:
    """Whether a socket binds to ``address`` (a host name or IP) here; ``None`` when it does not resolve."""
    infos = _resolve(address, 0, socket.SOCK_STREAM)
    if infos is None:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind(sockaddr)
            return True
        except OSError:
            continue
    return False


def route_interface(address: str, port: int = 9) -> tuple[str, str] | None:
    """The kernel's ``(interface, source address)`` to reach ``address``, or ``None`` (no route or no such host)."""
    for family, kind, proto, _, sockaddr in _resolve(address, port, socket.SOCK_DGRAM) or []:
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


def choose_interface(master_addr: str, environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], str]:
    """The ``IFNAME_VARS`` to set to reach ``master_addr`` and why; ``({}, why)`` when set or nothing routes there."""
    given = [f"{var}={environ[var]}" for var in IFNAME_VARS if environ.get(var)]
    if given:
        return {}, f"{' '.join(given)} set by the user"
    found = route_interface(master_addr)
    if found is None:
        unset = "GLOO_SOCKET_IFNAME left unset (gloo uses the address of this machine's hostname)"
        return {}, f"no local interface routes to MASTER_ADDR={master_addr}; {unset}"
    name, source = found
    why = f"GLOO_SOCKET_IFNAME={name} (routes to MASTER_ADDR={master_addr} from {source})"
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}, why
