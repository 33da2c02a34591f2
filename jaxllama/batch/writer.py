"""The job's output file: records written in the order of the job's lines, whatever order they finish in."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


class OrderedWriter:
    """Holds finished records by line number and writes each, flushed, as soon as it and every line before it are
    done. The output is thus always the answers to a prefix of the job's lines, which a resumed run continues.
    With `path` None (a process other than the one that writes), nothing is written."""

    def __init__(self, path: Path | None, order: Sequence[int]):
        self._file = open(path, "a", encoding="utf-8") if path is not None else None
        self._order = list(order)  # the line numbers to be written, in input order
        self._next = 0  # index in `_order` of the next line to write
        self._held: dict[int, dict] = {}  # line number -> finished record, waiting for earlier lines

    def put(self, number: int, record: dict) -> None:
        """A finished line's record; written now if every earlier line's is."""
        self._held[number] = record
        while self._next < len(self._order) and self._order[self._next] in self._held:
            record = self._held.pop(self._order[self._next])
            if self._file is not None:
                self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
                self._file.flush()
            self._next += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> OrderedWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
