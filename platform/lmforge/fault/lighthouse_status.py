"""What a torchft Lighthouse knows before a job's first step, read from its status page, and the start that waits
for every replica group.

torchft's Lighthouse forms a quorum once ``min_replicas`` groups have asked and every group it hears heartbeating
has asked: a group whose process is still starting (its imports, its Slurm job not yet running) is not
heartbeating, so the first quorum forms without it and it heals in at a later step. A job planned with N groups
then trains its first steps with fewer (a smaller global batch under DYNAMIC membership), and a comparison with one
job of N groups cannot hold. The Lighthouse has no option to wait for a count of groups at start (torchft 0.2.0),
so ``wait_for_groups`` does it on each rank before the first quorum: it polls the Lighthouse's ``/status`` page
(the HTML its dashboard shows: the current quorum id, and one line per heartbeating replica, marked ``old`` once it
is silent for the heartbeat timeout) until every planned group heartbeats, or until a quorum exists (the job is
already running: a restarted group joins it and heals), or until the timeout, after which the group starts
without the others and says which were missing. Every group's Manager heartbeats from its construction, so when
all N heartbeat the first quorum waits for all N (up to the Lighthouse's join timeout).

Why the status page and not a shared file: the Lighthouse is the one process every group already reaches (on
Slurm the groups are separate jobs on separate nodes), and a file left by a previous launch of the same run would
open the barrier early. tests/unit/test_lighthouse_status.py reads the page of a real Lighthouse, so a torchft
release that changes it fails there and not in a job.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, FrozenSet, Optional

QUORUM_ID = re.compile(r"Current quorum_id:\s*(\d+)")
# one heartbeat line: <li class="heartbeat [old]"> replica_<id>[:<uuid>]: seen <s>s ago </li>
HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*([^\s:]+)(?::\S+)?: seen')
GROUP_ID = re.compile(r"(\d+)$")


class StatusUnreadable(RuntimeError):
    """The Lighthouse answered, but not with a status page this module can read."""


@dataclass(frozen=True)
class LighthouseStatus:
    quorum_id: int  # 0 until the first quorum forms
    heartbeating: FrozenSet[int]  # the replica groups (their trailing number) heartbeating now


def read_status(lighthouse: str, timeout_s: float = 2.0) -> LighthouseStatus:
    """The Lighthouse's current quorum id and heartbeating groups (``lighthouse``: http://host:port); raises
    ``OSError`` when it cannot be reached and ``StatusUnreadable`` when its page has changed shape."""
    with urllib.request.urlopen(lighthouse.rstrip("/") + "/status", timeout=timeout_s) as reply:
        page = reply.read().decode("utf-8", "replace")
    quorum = QUORUM_ID.search(page)
    if quorum is None or "Heartbeats" not in page:
        raise StatusUnreadable(f"{lighthouse}/status has no 'Current quorum_id' or 'Heartbeats': {page[:200]!r}")
    groups = set()
    for old, replica in HEARTBEAT.findall(page):
        digits = GROUP_ID.search(replica)
        if not old and digits:
            groups.add(int(digits.group(1)))
    return LighthouseStatus(int(quorum.group(1)), frozenset(groups))


def wait_for_groups(
    lighthouse: str, groups: int, timeout_s: float, say: Callable[[str], None], poll_s: float = 0.2
) -> Optional[FrozenSet[int]]:
    """Block until every group 0..groups-1 heartbeats at the Lighthouse or a quorum exists; returns None then, or
    the missing groups once ``timeout_s`` passes (``say`` has announced them: this group starts without them)."""
    deadline = time.monotonic() + timeout_s
    planned = frozenset(range(groups))
    missing = planned
    while True:
        try:
            status = read_status(lighthouse)
        except StatusUnreadable as exc:
            say(f"lmforge: warning: replica_ft: not waiting for the other replica groups at start ({exc})")
            return planned
        except (OSError, urllib.error.URLError):  # not up yet: the Manager has reached it, so retry
            status = None
        if status is not None:
            if status.quorum_id > 0:
                return None
            missing = planned - status.heartbeating
            if not missing:
                return None
        if time.monotonic() >= deadline:
            say(
                f"lmforge: warning: replica_ft: replica group(s) {sorted(missing)} not heartbeating at the "
                f"Lighthouse after {timeout_s:g} s (fault.replica_quorum_timeout_s); starting without them: they "
                "heal in when they join"
            )
            return missing
        time.sleep(poll_s)
