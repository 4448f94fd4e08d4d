"""A lost peer never makes a repeated crash (fault/peer_loss.py, fault/verdict.py), on the exceptions torch really
raises: gloo's error in a survivor whose peer's sockets closed (two gloo process groups in this process, one per
thread, the second deleted), a TCPStore that cannot connect; the message of gloo's reset as seen in a 2-rank run
whose rank 1 was SIGKILLed (tests/distributed/test_verdicts.py)."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lmforge.fault import verdict as V
from lmforge.fault.drills import DrillCrash
from lmforge.fault.peer_loss import lost_peer

# rank 0's error when rank 1 was SIGKILLed during their collective (a 2-rank DDP run through torchrun, gloo)
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8870: Connection "
    "reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs "
    "of the remote worker before reporting an error."
)


def in_threads(fn, ranks=(0, 1)) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


@pytest.fixture(scope="module")
def gloo_peer_closed() -> RuntimeError:
    """What a gloo rank raises in a collective whose peer's process group is gone (its sockets closed)."""
    store, groups = dist.HashStore(), {}

    def build(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2, datetime.timedelta(seconds=20))

    in_threads(build)
    in_threads(lambda r: groups[r].allreduce([torch.ones(4)]).wait())  # connected
    del groups[1]  # rank 1 is gone: its process group closes its sockets, like a killed process's
    with pytest.raises(RuntimeError) as caught:
        groups[0].allreduce([torch.ones(4)]).wait()
    return caught.value


def test_gloo_error_after_a_peer_is_gone_is_a_lost_peer_and_never_a_repeated_crash(tmp_path, gloo_peer_closed):
    exc = gloo_peer_closed
    assert type(exc) is RuntimeError and "Connection closed by peer" in str(exc)  # gloo's class: plain RuntimeError
    assert lost_peer(exc)
    started = time.time()
    first = V.verdict_for(tmp_path, exc, rank=0, step=3, started=started)
    again = V.verdict_for(tmp_path, exc, rank=0, step=3, started=time.time() + 1)  # a later attempt, same step
    for v in (first, again):
        assert (v.kind, v.exit_code, v.deterministic) == (V.VerdictKind.CRASH, 1, False)
        assert v.message.startswith("RuntimeError: [") and v.message.endswith(
            "(a lost peer or network failure: never counted as a repeated crash)"
        )
        (path,) = map(Path, v.tracebacks)  # kept, alone: no earlier crash named
        assert path.name.startswith("step-00000003-RuntimeError-peer_lost-rank0-"), path
        assert "Connection closed by peer" in path.read_text() and "Traceback" in path.read_text()
    assert V.deciding(tmp_path) is None
    # a genuine RuntimeError at the same step is not matched against the lost-peer records, its repeat is
    later = time.time() + 2
    assert V.verdict_for(tmp_path, RuntimeError("bad shape"), 0, 3, later).kind is V.VerdictKind.CRASH
    repeat = V.verdict_for(tmp_path, RuntimeError("bad shape"), 0, 3, later + 1)
    assert repeat.kind is V.VerdictKind.REPEATED_CRASH and "peer_lost" not in "".join(repeat.tracebacks)


def test_negative_control_a_value_error_at_the_same_step_twice_is_a_repeated_crash(tmp_path):
    assert not lost_peer(ValueError("loss is nan"))
    assert V.verdict_for(tmp_path, ValueError("x"), 1, 3, time.time()).kind is V.VerdictKind.CRASH
    again = V.verdict_for(tmp_path, ValueError("x"), 1, 3, time.time() + 1)
    assert (again.kind, again.exit_code, again.deterministic) == (V.VerdictKind.REPEATED_CRASH, 46, True)
    assert [Path(p).name.split("-t")[0] for p in again.tracebacks] == ["step-00000003-ValueError-rank1"] * 2


def test_a_tcpstore_that_cannot_reach_its_server_is_a_lost_peer():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(dist.DistNetworkError) as caught:
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.3))
    assert lost_peer(caught.value)


@pytest.mark.parametrize(
    "exc, lost",
    [
        (RuntimeError(GLOO_RESET), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:606] Write error [10.0.0.2]:4021: Broken pipe"), True),
        (
            RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1800000ms for recv operation"),
            True,
        ),
        (dist.DistBackendError("NCCL error: remote process exited or there was a network error"), True),
        (dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"), True),
        (dist.DistStoreError("wait timeout after 300000ms, keys: /rdzv/last_participant"), True),
        # a programming or device error in NCCL recurs deterministically: it counts
        (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.21.5"), False),
        (dist.DistBackendError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"), False),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"), False),
        (DrillCrash("drill: crash on rank 1 after step 3"), False),
        (ConnectionResetError("Connection reset by peer"), False),  # not torch.distributed's: user I/O
    ],
)
def test_what_counts_as_a_lost_peer(exc, lost):
    assert lost_peer(exc) is lost


def test_a_lost_peer_behind_another_exception_is_found_in_the_chain(gloo_peer_closed):
    try:
        try:
            raise gloo_peer_closed
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as wrapped:
        assert lost_peer(wrapped)
    try:
        try:
            raise gloo_peer_closed
        except RuntimeError:
            raise KeyError("while cleaning up")  # noqa: B904  an error raised while handling the lost peer
    except KeyError as during:
        assert lost_peer(during)
