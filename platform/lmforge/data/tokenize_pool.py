"""Documents -> token ids, in input order: read ahead by a thread, tokenized in this process or in a pool of
``spawn``ed worker processes (one tokenizer each). The ids do not depend on the number of workers.
Used by ``lmforge data prepare`` (:mod:`lmforge.data.prepare`) and the sharded build (:mod:`lmforge.data.sharded_prepare`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import sys
import threading
from typing import Deque, Iterator, List, Optional

import numpy as np

from lmforge.data.tokenizer import Tokenizer, load_tokenizer

CHUNK_CHARS = 1 << 20  # text per worker task
FIRST_CHUNK_CHARS = 1 << 16  # the first chunks ramp up from here: tokenizing starts before 1 MiB is read


def _chunks(docs: Iterator[str], chunk_chars: int, first_chars: int = FIRST_CHUNK_CHARS) -> Iterator[List[str]]:
    """Lists of documents of about ``chunk_chars`` characters; the first ones are smaller (``first_chars``,
    doubling), so the tokenizer is busy while the reader is still filling the next chunk."""
    buf: List[str] = []
    size = 0
    limit = min(first_chars, chunk_chars)
    for doc in docs:
        buf.append(doc)
        size += len(doc)
        if size >= limit:
            yield buf
            buf, size = [], 0
            limit = min(2 * limit, chunk_chars)
    if buf:
        yield buf


def read_ahead(items: Iterator[List[str]], depth: int = 2) -> Iterator[List[str]]:
    """``items`` produced by a reader thread up to ``depth`` ahead: reading, decompressing and parsing the next
    chunk overlap with tokenizing this one (``encode_batch`` releases the GIL). The reader's errors (a malformed
    row) are raised here, in order; closing this generator stops the reader."""
    q: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def reader() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            put((None, e))
            return
        put((done, None))

    thread = threading.Thread(target=reader, name="lmforge-prepare-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        thread.join()


# ---- worker processes ------------------------------------------------------------------------------
_WORKER_TOKENIZER: Optional[Tokenizer] = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process = one core; the pool gives the parallelism
    _WORKER_TOKENIZER = load_tokenizer(spec)


def _encode_chunk(texts: List[str]) -> List[np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    dtype = np.uint16 if _WORKER_TOKENIZER.vocab_size <= 65536 else np.int32
    return [np.asarray(ids, dtype=dtype) for ids in _WORKER_TOKENIZER.encode_batch(texts)]


def tokenize_docs(
    docs: Iterator[str],
    tokenizer: Tokenizer,
    workers: int = 1,
    progress: bool = False,
    total_chars: Optional[int] = None,
    stats: Optional[dict] = None,
    pool: Optional[object] = None,
) -> Iterator[np.ndarray]:
    """Token ids of each document (a list or an array), in input order; ``workers`` > 1 tokenizes in that many
    processes.

    ``pool`` (from :func:`worker_pool`) reuses one pool across calls; otherwise one is started here.
    """
    from tqdm import tqdm

    bar = tqdm(
        total=total_chars,
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5,
    )
    stats = stats if stats is not None else {}
    stats.setdefault("chars", 0)
    try:
        if workers <= 1:
            for chunk in read_ahead(_chunks(docs, CHUNK_CHARS)):
                yield from tokenizer.encode_batch(chunk)  # id lists: write_shard converts each once
                n = sum(len(d) for d in chunk)
                stats["chars"] += n
                bar.update(n)
            return
        with contextlib.ExitStack() as stack:
            if pool is None:
                pool = stack.enter_context(worker_pool(tokenizer, workers))
            pending: Deque = collections.deque()
            for chunk in read_ahead(_chunks(docs, CHUNK_CHARS)):
                pending.append((pool.apply_async(_encode_chunk, (chunk,)), sum(len(d) for d in chunk)))
                while len(pending) > 2 * workers:  # bounded: the corpus never sits in memory whole
                    res, n = pending.popleft()
                    yield from res.get()
                    stats["chars"] += n
                    bar.update(n)
            while pending:
                res, n = pending.popleft()
                yield from res.get()
                stats["chars"] += n
                bar.update(n)
    finally:
        bar.close()


@contextlib.contextmanager
def worker_pool(tokenizer: Tokenizer, workers: int) -> Iterator[Optional[object]]:
    """``workers`` tokenizer processes (None for 1: tokenize in this process)."""
    if workers <= 1:
        yield None
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork: the parent may hold tokenizer / torch threads
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.source,)) as pool:
        yield pool
