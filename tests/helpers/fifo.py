"""A file replaced by a FIFO, as a user (or a cache copied with its special files) can leave one: opening it for
reading waits for a writer, forever. A test that reads one must fail, not hang, where the code under test regresses:
a reader still blocked after `seconds` is let go (a writer opens the FIFO and closes it, the reader sees it empty)
and the test is told."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


@contextlib.contextmanager
def fifo_instead_of(path: Path, seconds: float = 60):
    """Replace `path` by a FIFO for the block's duration; yields a list that holds True where some reader blocked on
    it had to be let go."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    done, blocked = threading.Event(), []

    def watch():
        while not done.wait(seconds):
            try:  # opens at once where a reader waits on it; ENXIO where none does (or ENOENT: it is gone)
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            blocked.append(True)
            os.close(fd)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield blocked
    finally:
        done.set()
        watcher.join()
