"""The largest value a quantity takes while a block runs (requests running at once, say), read on a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable


@contextlib.contextmanager
def peak_of(read: Callable[[], int], every: float = 0.001):
    """Yields a one-item list that holds the largest `read()` seen, every `every` seconds, until the block ends."""
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], read())
            time.sleep(every)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()
