"""Loopback-only networking for single-machine runs, and a check that it held.

torch's TCPStore listens on every interface even when told 127.0.0.1, so ranks use a FileStore and bind
gloo and NCCL to loopback; ``listening_addresses()`` proves nothing else was exposed.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_IFF_LOOPBACK = 0x8


def loopback_interface() -> str:
    """Name of the loopback network interface (``lo`` on Linux)."""
    net = Path("/sys/class/net")
    if net.is_dir():
        for dev in sorted(net.iterdir()):
            try:
                flags = int((dev / "flags").read_text().strip(), 16)
            except (OSError, ValueError):
                continue
            if flags & _IFF_LOOPBACK:
                return dev.name
    return "lo0" if os.uname().sysname == "Darwin" else "lo"


def loopback_env() -> dict[str, str]:
    """Environment that binds gloo and NCCL/RCCL bootstrap sockets to loopback."""
    lo = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode(hex_addr: str) -> str:
    addr_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(addr_hex)  # /proc stores an address as little-endian 32-bit words: IPv4 one, IPv6 four
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{ipaddress.ip_address(raw)}:{int(port_hex, 16)}"


def listening_addresses(pid: int | None = None) -> list[str]:
    """Local addresses of the TCP sockets ``pid`` (default: this process) listens on."""
    pid = pid or os.getpid()
    try:
        inodes = _socket_inodes(pid)
    except OSError:
        return []
    found: list[str] = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                found.append(_decode(cols[1]))
    return sorted(found)


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def exposed_addresses() -> list[str]:
    """Non-loopback addresses this process and its parent (torchrun's agent, which hosts the store) listen on."""
    found = {a for pid in (os.getpid(), os.getppid()) for a in listening_addresses(pid) if not is_loopback(a)}
    return sorted(found)
