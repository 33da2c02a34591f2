"""What a resumed job has done already: the records in its output and its journal (`writer.py`), matched to the
job's lines by id, and which lines still have to run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable
from pathlib import Path

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


@dataclasses.dataclass
class Plan:
    """Per line of the job, in order: its record from an earlier run if it counts as done, else the line runs
    (`duplicate`: the error it fails with at once, its id being an earlier line's)."""

    kept: dict[int, dict]  # line number -> record kept as it is
    todo: list[tuple[JobLine, DuplicateId | None]]
    retried: int = 0  # lines whose error record is replaced by running them again
    kept_errors: int = 0  # kept records that are errors (with retries off)
    others: list[dict] = dataclasses.field(default_factory=list)  # records of ids that no line of the job has


def plan(lines: list[JobLine], done: dict[Hashable, dict], retry_errors: bool) -> Plan:
    """Which lines run: those without a record, and with `retry_errors` those whose record is an error. A line
    whose id an earlier line has is never done: it fails again as a duplicate, which costs nothing."""
    result, seen = Plan({}, []), set()
    for line in lines:
        record = done.get(line.id) if line.id not in seen else None
        if line.id in seen:
            result.todo.append((line, DuplicateId(f"id {line.id!r} is used by an earlier line")))
        elif record is not None and not (retry_errors and records.is_error(record)):
            result.kept[line.number] = record
            result.kept_errors += records.is_error(record)
        else:
            result.retried += record is not None
            result.todo.append((line, None))
        seen.add(line.id)
    result.others = [record for rid, record in done.items() if rid not in seen]
    return result
