"""Files read from a cache folder (or a checkpoint), opened only where they are regular files, in a way that cannot
block. Anything may lie under a file's name in a folder someone else can write: a FIFO there blocks an `open` for
reading until some writer opens it, that is forever (the run hangs, with no message), and a device reads without end.
Such a file is refused as a damaged one is (`NotRegularFile`, an OSError: the caller makes the entry again, or names
the file), and is never opened blocking: its kind is looked up first (stat), then it is opened with O_NONBLOCK (a
FIFO put there in between opens at once, without a writer) and the kind of what was opened checked again (fstat).
Plain Python: the caches, the kernels' build and the checkpoint reader share it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class NotRegularFile(OSError):
    """A name that holds something other than a regular file (a FIFO, a device, a socket, a folder)."""

    def __init__(self, path: str | os.PathLike, mode: int):
        super().__init__(errno.EINVAL, f"not a regular file ({kind(mode)})", str(path))


def kind(mode: int) -> str:
    """What a file of `mode` (`st_mode`) is, in words: "a FIFO", ..."""
    return "a regular file" if stat.S_ISREG(mode) else KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading in binary, where it is a regular file (a link to one counts); NotRegularFile where
    it is anything else, FileNotFoundError where it is not there."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):  # not even opened: opening a device can act on it
        raise NotRegularFile(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between the two calls
            raise NotRegularFile(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # reads as any file's
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of `path`, a regular file (`open_regular`)."""
    with open_regular(Path(path)) as f:
        return f.read()
