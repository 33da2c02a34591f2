"""One writer per output: a job's output is written by one run at a time. A second `jaxllama run` on the same output
(from another shell, or a scheduler that started the job twice) is refused at once, before its model loads, naming
the run that holds it; without this both would append to the output and its journal, and each line would be answered
twice.

The lock is an advisory `flock` on OUT.jsonl.lock beside the output, held by the process that writes it (process 0
of a multi-host run) until it exits: the operating system releases it when the process ends however it ends (a kill,
a crash), so a lock is never left behind by a dead run. The file holds the holder's pid, for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class OutputBusy(OSError):
    """Another run holds the output's lock."""


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


class OutputLock:
    """Holds the lock of `output` from `acquire()` until `release()` or the process's end."""

    def __init__(self, output: Path):
        self.output, self.path = Path(output), lock_path(Path(output))
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        """Take the lock, or raise OutputBusy naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputBusy(f"another run (pid {holder}) is writing {self.output}; wait for it, or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
