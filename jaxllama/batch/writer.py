"""The job's output file: records written in the order of the job's lines, whatever order they finish in, and
kept as they finish in a journal beside it, so that a killed or interrupted job loses no finished line."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxllama.batch import records

SYNC_EVERY_S = 1.0  # the journal is fsynced at most this often: a lost machine loses at most this much work


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".journal")


class OrderedWriter:
    """Holds finished records by key (a line number) and writes each to the output, flushed, as soon as it and
    every record before it in `order` are. Each record is first appended to the journal (flushed at once, fsynced
    at most every `SYNC_EVERY_S`), whatever its place, since longest-first scheduling finishes lines far out of
    order. The output and the journal together thus always hold every finished line; a resumed run reads both
    back (`resume.load_records`). Once every record is in the output, the journal is removed.

    `known`: records done before this run (by key), kept as they are. At the start the output is rewritten
    (atomically) as the known records of the first keys of `order`, the rest of them going to a new journal.
    With `path` None (a process other than the one that writes), nothing is written."""

    def __init__(self, path: Path | None, order: Sequence[int], known: Mapping[int, dict] | None = None):
        self._order = list(order)
        self._next = 0  # index in `_order` of the next record to write
        self._held = {key: records.dumps(record) + "\n" for key, record in (known or {}).items()}
        self._output = self._journal = None
        if path is not None:
            self._restart(path)
        self._synced = time.monotonic()

    def _restart(self, path: Path) -> None:
        """Rewrite the output as the known records in order up to the first missing one, and the journal as the
        others; then open both to append. The output is replaced before the journal, so that a kill in between
        leaves the old journal, whose records the new output may also hold: a resume takes each once."""
        journal = journal_path(path)
        prefix = "".join(self._fold())
        if not (path.exists() and path.read_text(encoding="utf-8", errors="replace") == prefix):
            replace_file(path, prefix)
        if self._held:
            replace_file(journal, "".join(self._held.values()))
        else:
            journal.unlink(missing_ok=True)
        self._path = path
        self._output = open(path, "a", encoding="utf-8")
        self._journal = open(journal, "a", encoding="utf-8")

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
        for text in self._fold():
            self._output.write(text)
            self._output.flush()

    def _fold(self):
        """The held records whose turn has come, in order; each leaves `_held` as it is yielded."""
        while self._next < len(self._order) and self._order[self._next] in self._held:
            yield self._held.pop(self._order[self._next])
            self._next += 1

    @property
    def complete(self) -> bool:
        return self._next == len(self._order)

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
