"""slurm/env.sh's head-address guard (lmforge_is_loopback -> lmforge.launch.head_addr), through real bash.

Refused: a head that is this host's loopback (localhost, 127.0.0.1, Debian's 127.0.1.1 hostname line, ::1, a
name resolving to one of them). Passed: a distinct host, including a 127.100.x.y node of the test cluster, whose
namespace has lo reduced to 127.0.0.1/32 (tests/slurm/cluster.py; the 2-node Slurm jobs run with such a head).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.launch.head_addr import loopback_reason

REPO = Path(__file__).resolve().parents[2]


def is_loopback_sh(host: str):
    env = {
        **os.environ,
        "LMFORGE_PYTHON": sys.executable,
        "LMFORGE_REPO": str(REPO),
        "PYTHONPATH": str(REPO / "platform"),
    }
    proc = subprocess.run(
        ["bash", "-c", 'source "$LMFORGE_REPO/slurm/env.sh" && lmforge_is_loopback "$1"', "_", host],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout.strip()


def test_env_sh_refuses_this_hosts_loopback_and_passes_a_distinct_host(tmp_path):
    # One bash per case: the guard as train.sh runs it (exit 0 = loopback, with the reason on stdout).
    assert is_loopback_sh("localhost") == (0, "localhost is localhost")
    for addr in ("127.0.0.1", "127.0.1.1", "::1"):  # an ordinary host's lo is 127.0.0.1/8 and ::1/128
        rc, why = is_loopback_sh(addr)
        assert rc == 0 and why.startswith(f"{addr} is a loopback address of this host (on lo: "), (addr, rc, why)
    # 192.0.2.0/24 is TEST-NET-1: never assigned, resolved without any lookup (a numeric address).
    assert is_loopback_sh("192.0.2.7") == (1, "")


NODE_LO = [ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("::1/128")]  # a test-cluster node's lo
HOST_LO = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]  # an ordinary host's lo


@pytest.mark.parametrize(
    "host,lo,loopback",
    [
        ("127.100.37.1", NODE_LO, False),  # test-cluster head, seen from a node: a distinct host on eth0
        ("127.100.37.1", HOST_LO, True),  # the same address on an ordinary host is its own loopback
        ("127.0.0.1", NODE_LO, True),
        ("localhost", NODE_LO, True),  # by name, whatever lo holds
        ("LOCALHOST.", NODE_LO, True),
        ("::1", [ipaddress.ip_network("127.0.0.1/32")], True),  # ::1 even where lo lists no IPv6 address
        ("10.1.2.3", HOST_LO, False),
    ],
)
def test_loopback_reason_against_the_lo_prefixes(host, lo, loopback):
    assert (loopback_reason(host, lo) is not None) == loopback
