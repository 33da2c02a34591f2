"""The job's output file: records written in the order of the job's lines, whatever order they finish in, and
kept as they finish in a journal beside it, so that a killed or interrupted job loses no finished line."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from jaxllama.batch import records

SYNC_EVERY_S = 1.0  # the journal is fsynced at most this often: a lost machine loses at most this much work


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".journal")


class OrderedWriter:
    """Holds finished records by key (a line number) and writes each to the output, flushed, as soon as it and
    every record before it in the order are. Each record is first appended to the journal (flushed at once, fsynced
    at most every `SYNC_EVERY_S`), whatever its place, since longest-first scheduling finishes lines far out of
    order. The output and the journal together thus always hold every finished line; a resumed run reads both
    back (`resume.load_records`). Once every record is in the output, the journal is removed.

    The order is told as the job is read (`expect`, then `end`), or given whole (`order`, with `known`: records done
    before this run, by key). `kept`: the records of earlier runs; at the start they become the journal and the
    output starts empty, each written to it again as its line's turn comes. With `path` None (a process other than
    the one that writes), nothing is written."""

    def __init__(
        self,
        path: Path | None,
        order: Sequence[int] | None = None,
        known: Mapping[int, dict] | None = None,
        kept: Iterable[dict] = (),
    ):
        self._order: collections.deque[int] = collections.deque()  # the keys expected and not yet written
        self._held: dict[int, str] = {}
        self._ended = False
        self._output = self._journal = None
        if path is not None:
            self._restart(path, [*kept, *(known or {}).values()])
        self._synced = time.monotonic()
        if order is not None:
            for key in order:
                self.expect(key, (known or {}).get(key))
            self.end()

    def _restart(self, path: Path, kept: list[dict]) -> None:
        """The journal rewritten as the records kept, then the output emptied; both opened to append. The journal is
        replaced before the output, so that a kill in between leaves every record in one or the other."""
        journal = journal_path(path)
        if kept:
            replace_file(journal, "".join(records.dumps(record) + "\n" for record in kept))
        if path.exists() and path.stat().st_size:
            replace_file(path, "")
        if not kept:
            journal.unlink(missing_ok=True)
        self._path = path
        self._output = open(path, "a", encoding="utf-8")
        self._journal = open(journal, "a", encoding="utf-8")

    def expect(self, key: int, record: dict | None = None) -> None:
        """The next key of the order; `record`: its record, kept from an earlier run (in the journal already)."""
        if self._journal is None:
            return
        self._order.append(key)
        if record is not None:
            self._held[key] = records.dumps(record) + "\n"
        self._write()

    def end(self) -> None:
        """Every key of the order has been told."""
        self._ended = True

    def put(self, key: int, record: dict) -> None:
        """A finished record: kept in the journal at once, written to the output as soon as its turn comes."""
        if self._journal is None:  # a process that does not write holds nothing either
            return
        text = records.dumps(record) + "\n"
        self._journal.write(text)
        self._journal.flush()
        if time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self._journal.fileno())
            self._synced = time.monotonic()
        self._held[key] = text
        self._write()

    def _write(self) -> None:
        """Write the held records whose turn has come, in order."""
        while self._order and self._order[0] in self._held:
            self._output.write(self._held.pop(self._order.popleft()))
        self._output.flush()

    @property
    def complete(self) -> bool:
        return self._ended and not self._order

    def close(self) -> None:
        """Make what was written durable; once the output holds every record, remove the journal."""
        if self._output is None:
            return
        for f in (self._output, self._journal):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if self.complete:
            journal_path(self._path).unlink(missing_ok=True)
        self._output = self._journal = None

    def __enter__(self) -> OrderedWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def replace_file(path: Path, text: str) -> None:
    """Write a file whole or not at all: a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
