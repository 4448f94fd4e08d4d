"""Is an exception a lost peer? What a surviving rank raises when another rank dies or the network fails.

When a rank is killed from outside (the OOM killer, a failed node, an operator's SIGKILL) it raises nothing and
records nothing; its peers die in their next collective with a communication error. That error says nothing about
the code: two attempts that lose a peer at the same step are not a deterministic crash, so the repeated-crash rule
(fault/verdict.py) never counts it. Recognised, on the exception or anything in its ``__cause__`` /
``__context__`` chain:

* torch.distributed's classes for backend, network and store failures (``DistError`` and its subclasses
  ``DistBackendError``, ``DistNetworkError``, ``DistStoreError``: NCCL errors and watchdog aborts, TCPStore
  connections), except a backend error whose message names a programming or device error (NCCL's invalid usage
  or argument, a CUDA error, out of memory), which can recur deterministically;
* a plain ``RuntimeError`` with gloo's messages for a dead or unreachable peer (its TCP transport: ``Connection
  closed by peer``, ``Read error ...: Connection reset by peer``, a broken pipe, a refused connection, a timed-out
  send or receive) or NCCL's (``remote process exited or there was a network error``, an aborted communicator).

Matched by class name and module, so this module imports no torch.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

DIST_ERRORS = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})
PEER_LOST = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|timed out waiting \d+ms for (recv|send)"
    r"|remote process exited|network error|communicator was aborted",
    re.IGNORECASE,
)
PROGRAM_ERROR = re.compile(r"invalid usage|invalid argument|cuda error|illegal memory access|out of memory", re.I)


def chain(exc: Optional[BaseException], limit: int = 16) -> Iterator[BaseException]:
    """``exc``, then its causes and contexts (each once, at most ``limit``)."""
    seen = set()
    todo = [exc] if exc is not None else []
    while todo and len(seen) < limit:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def is_dist_error(exc: BaseException) -> bool:
    return any(c.__name__ in DIST_ERRORS and c.__module__.startswith("torch") for c in type(exc).__mro__)


def lost_peer(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is a communication failure: a peer died or the network failed."""
    for e in chain(exc):
        text = str(e)
        if is_dist_error(e) and not PROGRAM_ERROR.search(text):
            return True
        if isinstance(e, RuntimeError) and PEER_LOST.search(text):
            return True
    return False
