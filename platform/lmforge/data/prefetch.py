"""Background preparation of the next optimizer steps' micro batches (``data.num_workers >= 1``).

:class:`StepPrefetcher` keeps the micro batches of the next ``depth`` optimizer steps in flight on a pool of
``num_workers`` daemon threads while the current step trains; :class:`~lmforge.data.loader.BatchStream` asks it
for the step that starts at its ``consumed_samples`` and hands the result to the trainer.

Why threads, not processes. A micro batch is a few memmap reads from megatron-core's indices and the shard
(numpy copies out of the page cache release the GIL, and so do the page faults behind them), one ``np.stack``
and, on CUDA, a copy into pinned memory (also GIL-free). The goal is to hide that latency behind the training
step, not to use more cores: the loader already builds tokens 20x-10^5x faster than a rank trains
(``benchmarks/data_loader.py``), and the step's torch kernels and CUDA waits release the GIL too. Processes
would need the mixture (megatron-core datasets holding memmaps) to be picklable, a shared-memory hand-off of
every batch and a start-up cost per worker, for no throughput the threads lack. The datasets are read-only
once built: lmforge never sets megatron-core's ``defer_npy_index_mmap``, so every index array is loaded before
the first read and concurrent ``train_text`` calls share no mutable state.

Exactness. A step is identified by the consumed-samples position it starts at, and a micro batch is a pure
function of its sample indices, so a prefetched step is bit-identical to one built on demand. Nothing here
changes the stream's state: ``consumed_samples`` counts only the steps handed to the trainer. A request for a
position other than the one queued first (a resume, a state set by hand) drops everything queued and starts
over from that position; :meth:`StepPrefetcher.drop` does the same explicitly.

Errors and shutdown. A worker's exception is stored in the micro batch's future and raised, with the worker's
traceback and a note naming the samples, in the training loop when that step is taken, never earlier (a
prefetched step past the end of the data only fails if the trainer asks for it). ``close()`` cancels what has
not started, stops the threads and joins them. A pool nobody closed is stopped the same way at interpreter exit
(an ``atexit`` hook, bounded wait): left running into finalization, a daemon thread inside numpy/torch code can
abort the process ("terminate called without an active exception"). The threads are daemons, so a worker stuck
past that wait still never keeps the process alive.
"""

from __future__ import annotations

import atexit
import queue
import threading
import warnings
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Callable, Deque, Generic, List, Optional, Sequence, Tuple, TypeVar, Union

T = TypeVar("T")
_STOP = object()


def _describe(part: Sequence[int]) -> str:
    return f"samples [{part.start}, {part.stop})" if isinstance(part, range) else f"part {part!r}"


class WorkerPool:
    """``num_workers`` daemon threads running submitted calls in FIFO order; results come back as futures."""

    live: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()  # pools not closed yet (stopped at exit)

    def __init__(self, num_workers: int, name: str = "lmforge-data"):
        if num_workers < 1:
            raise ValueError(f"a worker pool needs at least one thread, got {num_workers}")
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(num_workers)
        ]
        for t in self.threads:
            t.start()
        WorkerPool.live.add(self)

    def submit(self, fn: Callable[..., T], *args, note: str = "") -> "Future[T]":
        fut: "Future[T]" = Future()
        self._tasks.put((fut, fn, args, note))
        return fut

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is _STOP:
                return
            fut, fn, args, note = item
            del item
            if not fut.set_running_or_notify_cancel():  # cancelled (dropped or closed) before it started
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - every failure goes to the loop that waits for it
                if note:
                    e.add_note(f"(raised in data worker thread {threading.current_thread().name} {note})")
                fut.set_exception(e)
            else:
                fut.set_result(result)
            del fut, fn, args

    def close(self, timeout: float = 30.0, cancel_queued: bool = False) -> bool:
        """Stop every thread after its current call (``cancel_queued``: calls not started are cancelled rather
        than run first); True when all of them ended within ``timeout``."""
        WorkerPool.live.discard(self)
        while cancel_queued:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].cancel()
        for _ in self.threads:
            self._tasks.put(_STOP)
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)


@atexit.register
def _stop_pools_left_open() -> None:
    """At interpreter exit, while the interpreter is still whole: stop every pool nobody closed (a stream
    dropped without ``close()``), so no worker is inside numpy/torch code when finalization begins."""
    for pool in list(WorkerPool.live):
        pool.close(timeout=10.0, cancel_queued=True)


class StepPrefetcher(Generic[T]):
    """Builds whole optimizer steps ahead of the trainer, in order, keyed by their start position.

    ``step_parts(start)`` gives the arguments of each micro batch of the step starting at consumed position
    ``start`` (its sample ranges); ``build(part)`` makes one micro batch; ``step_size(start)`` is the global batch
    of the step starting at ``start`` (a batch ramp varies it; an int: every step's).
    """

    def __init__(
        self,
        build: Callable[[Sequence[int]], T],
        step_parts: Callable[[int], List[Sequence[int]]],
        step_size: Union[int, Callable[[int], int]],
        num_workers: int,
        depth: int = 2,
    ):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1 step, got {depth}")
        self.build, self.step_parts = build, step_parts
        self.step_size = step_size if callable(step_size) else (lambda _start: step_size)
        self.num_workers, self.depth = num_workers, depth
        self.pool: Optional[WorkerPool] = None  # started on the first take(): a stream used only for eval has none
        self._ahead: Deque[Tuple[int, List[Future]]] = deque()
        self.closed = False

    def _queue_step(self, start: int) -> None:
        assert self.pool is not None
        parts = self.step_parts(start)
        self._ahead.append(
            (
                start,
                [
                    self.pool.submit(
                        self.build, p, note=f"building {_describe(p)} of the step at consumed_samples={start}"
                    )
                    for p in parts
                ],
            )
        )

    def _top_up(self, start: int) -> None:
        """Queue the ``depth`` steps from ``start`` on that are not queued yet."""
        nxt = self._ahead[-1][0] + self.step_size(self._ahead[-1][0]) if self._ahead else start
        while len(self._ahead) < self.depth:
            self._queue_step(nxt)
            nxt += self.step_size(nxt)

    def take(self, start: int) -> List[T]:
        """The micro batches of the step starting at ``start``; then the steps up to ``depth`` ahead are queued."""
        if self.closed:
            raise RuntimeError("the data prefetcher is closed")
        if self.pool is None:
            self.pool = WorkerPool(self.num_workers)
        if self._ahead and self._ahead[0][0] != start:
            self.drop()  # the stream moved (resume, or state set by hand): what was prefetched is for elsewhere
        self._top_up(start)
        _, futures = self._ahead.popleft()
        batches = [f.result() for f in futures]  # a worker's exception is raised here, with its traceback
        # Queue the next step only now: freshly woken workers would otherwise compete with this thread for the
        # GIL while it collects the batches the loop is waiting for.
        self._top_up(start + self.step_size(start))
        return batches

    def drop(self) -> None:
        """Forget every queued step (the ones already running finish and are discarded)."""
        while self._ahead:
            for f in self._ahead.popleft()[1]:
                f.cancel()

    def queued_starts(self) -> List[int]:
        return [start for start, _ in self._ahead]

    def close(self, timeout: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        self.drop()
        if self.pool is not None and not self.pool.close(timeout):
            warnings.warn(
                f"data: a prefetch thread was still reading after {timeout:.0f} s; it is a daemon and "
                "is left to end with the process",
                stacklevel=2,
            )
