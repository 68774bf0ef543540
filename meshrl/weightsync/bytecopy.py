"""Copying host bytes into a staging buffer without waiting on threads the OS has not run.

torch's `copy_` splits a copy of 32 KiB or more over its intra-op threads and waits for all
of them. On a busy machine a worker thread may not be scheduled for a while: on 2 cores
that cost up to ~8 ms per tensor (measured: a 0.3 MB publish took 13 ms instead of 0.5 ms,
a 29 MB one 20-70 ms instead of 5 ms). Here the calling thread and one helper thread take
pieces from a shared list in turn; the caller waits only for a piece the helper already
took, so a helper that never ran delays nothing.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

PIECE_BYTES = 16 << 20  # big copies are cut into pieces of this size
HELPED_BYTES = 64 << 20  # below this the caller copies alone: waking a helper buys nothing
_helper = ThreadPoolExecutor(1, thread_name_prefix="ws-copy")


def copy_pieces(pairs: list[tuple[np.ndarray, np.ndarray]], progress: Callable[[int], None] | None = None) -> None:
    """dst[:] = src for every (dst, src) pair of uint8 arrays (numpy releases the GIL).
    `progress(k)`, if given, is called when the first k pairs are all copied, each time
    another PIECE_BYTES are (k grows; not at the end: the caller knows when it returns)."""
    pieces = [(i, d[a : a + PIECE_BYTES], s[a : a + PIECE_BYTES]) for i, (d, s) in enumerate(pairs) for a in range(0, s.size, PIECE_BYTES)]
    shared = _SharedPieces(pieces, [s.size for _, s in pairs], progress)
    if sum(s.size for _, _, s in pieces) >= HELPED_BYTES:
        _helper.submit(shared.work)
    shared.work()
    shared.wait()


class _SharedPieces:
    def __init__(self, pieces: list[tuple[int, np.ndarray, np.ndarray]], pair_sizes: list[int], progress: Callable[[int], None] | None):
        self._pieces = pieces
        self._next = 0
        self._busy = 0  # pieces taken and not yet copied
        self._sizes = pair_sizes
        self._left = [0] * len(pair_sizes)  # pieces of each pair not yet copied
        for i, _, _ in pieces:
            self._left[i] += 1
        self._done_pairs = 0  # leading pairs all copied
        self._unreported = 0  # bytes of those pairs copied since the last progress report
        self._progress = progress
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def work(self) -> None:
        while (piece := self._take()) is not None:
            pair, dst, src = piece
            try:
                dst[:] = src
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller by wait()
                self._error = e
            finally:
                self._finish(pair)

    def _take(self) -> tuple[int, np.ndarray, np.ndarray] | None:
        with self._cond:
            if self._next == len(self._pieces) or self._error is not None:
                return None
            self._next += 1
            self._busy += 1
            return self._pieces[self._next - 1]

    def _finish(self, pair: int) -> None:
        with self._cond:
            self._busy -= 1
            self._left[pair] -= 1
            while self._done_pairs < len(self._left) and self._left[self._done_pairs] == 0:
                self._unreported += self._sizes[self._done_pairs]
                self._done_pairs += 1
            # Rare reports: each one wakes the waiting writer, which then competes for the GIL.
            if self._progress is not None and self._unreported >= PIECE_BYTES and self._error is None:
                self._unreported = 0
                self._progress(self._done_pairs)  # under the lock: reports arrive in order
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)
        if self._error is not None:
            raise self._error
