"""What a resumed job has done already: the records in its output and its journal (`writer.py`), matched to the
job's lines by id, and which lines still have to run."""

from __future__ import annotations

import array
import hashlib
import json
from collections.abc import Hashable, Iterable
from pathlib import Path

import numpy as np

from jaxllama.batch import records
from jaxllama.batch.jobs import JobLine
from jaxllama.batch.writer import journal_path
from jaxllama.errors import DuplicateId


def load_records(output: Path) -> dict[Hashable, dict]:
    """The finished records, by id, from the output and then its journal. A line that is not a whole JSON object
    with an id (a line cut by a kill, or anything else) is ignored, and redone. When two records answer the same
    id, an answer beats an error record (a retried line's), and else the later one wins."""
    done: dict[Hashable, dict] = {}
    for path in (output, journal_path(output)):
        for record in _read_records(path):
            rid = records.record_id(record)
            if rid not in done or records.is_error(done[rid]) or not records.is_error(record):
                done[rid] = record
    return done


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    found = []
    for raw in path.read_bytes().split(b"\n"):
        try:
            record = json.loads(raw)
            if isinstance(record, dict) and isinstance(records.record_id(record), Hashable):
                found.append(record)
        except (ValueError, RecursionError):  # not JSON (a cut line), or not UTF-8
            continue
    return found


class Planner:
    """Which lines of a job run, decided line by line as the job streams past, in memory that does not grow with the
    job: `scan` first reads every line once (counting what will be kept or run again, and finding the ids that more
    than one line has, by 8-byte hashes of all of them), then `decide` says, for each line again in order, whether
    it is done already (its record), a duplicate (its error) or to run.

    A line runs if it has no record, or, with `retry_errors`, an error record. A line whose id an earlier line has is
    never done: it fails again as a duplicate, which costs nothing. `done`: the records of earlier runs, by id
    (`load_records`)."""

    def __init__(self, done: dict[Hashable, dict], retry_errors: bool):
        self.done, self.retry_errors = done, retry_errors
        self.lines = self.kept = self.kept_errors = self.retried = 0
        self._repeated: set[int] = set()  # hashes of the ids more than one line has (or that collide)
        self._seen: set[Hashable] = set()  # of those ids, the ones already decided
        self._matched: set[Hashable] = set()  # ids of `done` that a line has

    def scan(self, lines: Iterable[JobLine]) -> None:
        hashes = array.array("Q")  # 8 bytes a line
        for line in lines:
            self.lines += 1
            hashes.append(_id_hash(line.id))
            if line.id in self.done and line.id not in self._matched:  # its first line takes the record
                self._matched.add(line.id)
                record = self.done[line.id]
                if self.retry_errors and records.is_error(record):
                    self.retried += 1
                else:
                    self.kept += 1
                    self.kept_errors += records.is_error(record)
        ordered = np.frombuffer(hashes, np.uint64)  # the array's own memory, sorted in place: no copy of it
        ordered.sort()
        self._repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())

    def decide(self, line: JobLine) -> tuple[dict | None, DuplicateId | None]:
        """(its record, where the line is done already; the error it fails with, where its id is an earlier line's)."""
        if self._repeated and _id_hash(line.id) in self._repeated:  # hashed again only where some id repeats
            if line.id in self._seen:
                return None, DuplicateId(f"id {line.id!r} is used by an earlier line")
            self._seen.add(line.id)
        record = self.done.get(line.id)
        if record is not None and not (self.retry_errors and records.is_error(record)):
            return record, None
        return None, None

    def others(self) -> list[dict]:
        """The records of earlier runs whose ids no line of the job has (kept, after the job's lines)."""
        return [record for rid, record in self.done.items() if rid not in self._matched]


def _id_hash(rid: Hashable) -> int:
    text = f"{type(rid).__name__}:{rid}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
