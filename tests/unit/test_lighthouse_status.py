"""The start that waits for every replica group (lmforge.fault.lighthouse_status), against a real torchft Lighthouse
served in this process: its status page is read (quorum id, heartbeating groups, a silent one marked old), the wait
ends when the last planned group heartbeats or once a quorum exists, and otherwise times out naming the missing
groups; a page it cannot read is announced, never waited on."""

from __future__ import annotations

import http.server
import threading
import time
from datetime import timedelta

import pytest
from torchft._torchft import LighthouseClient, LighthouseServer

from lmforge.fault.lighthouse_status import StatusUnreadable, read_status, wait_for_groups


@pytest.fixture
def lighthouse(request):
    """A Lighthouse (its address and a client); a silent replica is old after ``heartbeat_ms`` (default 10 s)."""
    heartbeat_ms = getattr(request, "param", 10_000)
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=heartbeat_ms
    )
    addr = server.address()
    yield addr, LighthouseClient(addr, connect_timeout=timedelta(seconds=5))
    server.shutdown()


@pytest.mark.parametrize("lighthouse", [300], indirect=True)
def test_the_page_names_the_heartbeating_groups_and_drops_a_silent_one(lighthouse):
    addr, client = lighthouse
    assert read_status(addr).heartbeating == frozenset() and read_status(addr).quorum_id == 0
    client.heartbeat("replica_0:9f1c")  # a Manager's id: the group's, then a uuid of this launch
    client.heartbeat("replica_12:77aa")
    assert read_status(addr).heartbeating == {0, 12}
    time.sleep(0.5)  # past heartbeat_timeout_ms: both are marked old
    client.heartbeat("replica_12:0b0b")  # group 12 restarted (a new uuid), group 0 silent
    assert read_status(addr).heartbeating == {12}


def test_the_wait_ends_when_the_last_group_heartbeats(lighthouse):
    addr, client = lighthouse
    client.heartbeat("replica_0:a")
    said = []
    late = threading.Timer(0.4, lambda: client.heartbeat("replica_1:b"))
    late.start()
    start = time.monotonic()
    try:
        assert wait_for_groups(addr, 2, 30.0, said.append, poll_s=0.05) is None
    finally:
        late.cancel()
    assert 0.35 < time.monotonic() - start < 5 and said == []


def test_a_group_missing_at_the_timeout_is_named_and_the_start_goes_on(lighthouse):
    addr, client = lighthouse
    client.heartbeat("replica_1:a")
    said = []
    assert wait_for_groups(addr, 3, 0.3, said.append, poll_s=0.05) == {0, 2}
    assert len(said) == 1 and "replica group(s) [0, 2] not heartbeating" in said[0], said


def test_once_a_quorum_exists_a_restarted_group_does_not_wait(lighthouse):
    addr, client = lighthouse
    client.heartbeat("replica_0:a")
    client.quorum("replica_0:a", timeout=timedelta(seconds=5), address="m", store_address="s", step=0, world_size=1)
    assert read_status(addr).quorum_id == 1
    said = []
    start = time.monotonic()
    assert wait_for_groups(addr, 4, 30.0, said.append) is None  # groups 1-3 are not heartbeating
    assert time.monotonic() - start < 5 and said == []


def test_a_page_that_is_not_a_lighthouse_status_is_announced_not_waited_on():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>some other server</html>")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        addr = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(StatusUnreadable, match="no 'Current quorum_id'"):
            read_status(addr)
        said = []
        assert wait_for_groups(addr, 2, 30.0, said.append) == {0, 1}
        assert len(said) == 1 and "not waiting for the other replica groups" in said[0], said
    finally:
        server.shutdown()
        server.server_close()
