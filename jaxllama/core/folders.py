"""Folders written whole: a writer fills a temporary folder beside its target OUT and renames it into place, so that
OUT is at every instant absent, the old folder or the new one, each whole; never a mix, never a half.

    tmp = temporary_path(out)                  # .OUT.tmp-PID-RANDOM, beside OUT
    ...                                        # write everything into tmp
    put_in_place(tmp, out, replace=True)       # OUT is now tmp's content; the old OUT is removed

Replacing a folder is one step where the system swaps two folders atomically (Linux's `renameat2` with
RENAME_EXCHANGE, on ext4, xfs, btrfs, tmpfs and most others). Elsewhere it takes two: the old OUT is renamed aside to
`.OUT.old-PID-RANDOM`, then the new one into its place; a writer killed between the two leaves no OUT, and
`finish_swap`, which each command that reads or writes OUT calls first, puts the old one back. Folders left by writers
that are gone are removed (`remove_stale_tmp`, `finish_swap`); those of a writer at work (its process running) are
never touched. Plain Python, no jax: `converters` and the checkpoint reader share it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import sys
import uuid
from pathlib import Path

TMP, OLD = ".tmp-", ".old-"  # a writer's new folder; the old folder it moved aside (`.OUT` + tag + `PID-RANDOM`)


def temporary_path(out_dir: Path) -> Path:
    """Where a writer of `out_dir` writes before renaming it into place: `.NAME.tmp-PID-RANDOM` beside it, so that
    `remove_stale_tmp` can tell a writer at work (its process running) from one that was killed."""
    return _beside(out_dir, TMP)


def _beside(out_dir: Path, tag: str) -> Path:
    return out_dir.with_name(f".{out_dir.name}{tag}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_tmp(out_dir: str | Path) -> list[Path]:
    """Remove the temporary folders of writers of `out_dir` that are gone (killed before they could clean up):
    those whose name carries the id of no running process, or none (written before names carried one). `out_dir`'s
    name may be a glob pattern ("*": the writers of every folder beside it). Returns what was removed."""
    out_dir = Path(out_dir)
    removed = []
    for tmp in out_dir.parent.glob(f".{out_dir.name}{TMP}*"):
        if _owner_alive(tmp, TMP):
            continue  # a writer at work, maybe another conversion racing for the same name
        _remove(tmp)
        removed.append(tmp)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the process is only looked up
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _owner_alive(folder: Path, tag: str) -> bool:
    owner = folder.name.rpartition(tag)[2].split("-")[0]
    return owner.isdigit() and process_alive(int(owner))


def _remove(path: Path) -> None:
    """Remove a folder, or the link that stands for one (not what it points to)."""
    if path.is_symlink():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def put_in_place(new: Path, out: Path, replace: bool = False) -> None:
    """Rename folder `new` to `out`. Where `out` is a folder that is not empty: FileExistsError, unless `replace`; then
    `new` takes its place (in one step where the system swaps folders, else in two that `finish_swap` completes if this
    process dies between them) and the old `out` is removed."""
    if not replace:
        try:
            os.rename(new, out)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(f"{out}: already exists and is not empty (pass --overwrite to replace)") from None
            raise
        return
    try:
        swapped = _exchange(new, out)
    except FileNotFoundError:  # no `out` to replace
        os.rename(new, out)
        return
    if swapped:
        _remove(new)  # which holds the old `out` now
        return
    aside = _beside(out, OLD)
    try:
        os.rename(out, aside)
    except FileNotFoundError:
        aside = None
    try:
        os.rename(new, out)
    except OSError:
        if aside is not None:
            with contextlib.suppress(OSError):
                os.rename(aside, out)
        raise
    if aside is not None:
        _remove(aside)


def finish_swap(out_dir: str | Path) -> None:
    """Repair what a writer killed while replacing `out_dir` left (`put_in_place` in two steps): where `out_dir` is
    missing, the old folder it moved aside is put back; where `out_dir` is there, the old folder is removed. Folders of
    writers at work are left alone. Errors (a folder one may not list or write) are ignored: the caller then finds
    `out_dir` as it is."""
    out_dir = Path(out_dir)
    prefix = f".{out_dir.name}{OLD}"
    with contextlib.suppress(OSError):
        for aside in sorted(p for p in out_dir.parent.iterdir() if p.name.startswith(prefix)):
            if _owner_alive(aside, OLD):
                continue
            if not os.path.lexists(out_dir):
                with contextlib.suppress(OSError):  # another process may have put it back first
                    os.rename(aside, out_dir)
                continue
            _remove(aside)


AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


@functools.cache
def _renameat2():
    """libc's renameat2 (glibc 2.28+, musl 1.2.5+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders (or files) at `a` and `b` in one step; False where the system or the file system cannot (no
    renameat2, or no RENAME_EXCHANGE: NFS, some FUSE file systems), and nothing was done."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))
