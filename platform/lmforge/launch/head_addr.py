"""Is a rendezvous address this host's own loopback? (slurm/env.sh's ``lmforge_is_loopback``)

    python -m lmforge.launch.head_addr HOST     exit 0 and print why when HOST is loopback here, else exit 1

The failure it guards against: on a multi-node job the head node's name resolves, on the head itself, to
``localhost`` / 127.0.0.1 / Debian's 127.0.1.1 hostname line / ``::1``; the other nodes then try to
rendezvous with *their own* loopback and hang. An address counts as loopback when it is ``localhost``, is a
loopback address that this host routes to its ``lo`` interface (inside a prefix of one of lo's addresses:
127.0.0.1/8 on an ordinary host), or ``::1``. A 127.x address that lives on a real interface (the test
cluster's nodes: 127.100.x.y on each namespace's eth0, lo reduced to 127.0.0.1/32) is a distinct host and passes.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
from typing import List, Optional, Sequence

Net = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_LO: List[Net] = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]


def lo_networks() -> List[Net]:
    """The prefixes of this host's ``lo`` addresses (``ip -j addr show dev lo``); 127/8 and ::1 without iproute2."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show", "dev", "lo"], capture_output=True, text=True, timeout=10)
        infos = [a for link in json.loads(out.stdout or "[]") for a in link.get("addr_info", [])]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return list(DEFAULT_LO)
    nets = [ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False) for a in infos if "local" in a]
    return nets or list(DEFAULT_LO)


def resolve(host: str) -> List[str]:
    """Every address ``host`` resolves to here (a numeric address is itself; an unknown name: none)."""
    try:
        return sorted({info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)})
    except (socket.gaierror, UnicodeError):
        return []


def loopback_reason(host: str, lo: Optional[Sequence[Net]] = None) -> Optional[str]:
    """Why ``host`` is this host's loopback (None: it is not)."""
    if host.strip().lower().rstrip(".") in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return f"{host} is localhost"
    nets = list(lo_networks() if lo is None else lo)
    for addr in resolve(host) or [host]:
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            continue
        if ip.is_loopback and any(ip in net for net in nets if net.version == ip.version):
            via = "" if addr == host else f" resolves to {addr}, which"
            return f"{host}{via} is a loopback address of this host (on lo: {', '.join(map(str, nets))})"
        if ip.version == 6 and ip == ipaddress.ip_address("::1"):
            return f"{host} is ::1"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m lmforge.launch.head_addr HOST", file=sys.stderr)
        return 2
    reason = loopback_reason(args[0])
    if reason:
        print(reason)
        return 0
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
