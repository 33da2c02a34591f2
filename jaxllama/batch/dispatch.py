"""Which job lines go to which replica, and what becomes of the lines of a replica that dies: plain Python, no
distributed engine, so that a driver's choices can be tested and timed alone.

Lines go out in blocks, small enough that every replica stays busy to the end and none waits for a static share.
Lines that start alike (a few-shot context, a shared system prompt: `affinity`) form blocks of their own, and a
replica that took a block of a kind is offered that kind first, so that its prefix cache holds that prefix once
rather than every replica computing it.

A replica that dies loses its blocks in flight: their lines are offered again. A line lost `SUSPECT_AFTER` times
runs alone on a replica with nothing else in flight, so that one line that kills its replica cannot take the
others with it; lost `MAX_TRIES` times, it is answered with an error record (`ReplicaLost`).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Hashable

from jaxllama.batch import records
from jaxllama.batch.jobs import JobLine
from jaxllama.batch.runner import Answered
from jaxllama.errors import ReplicaLost

MAX_TRIES = 3
SUSPECT_AFTER = 2
AFFINITY_CHARS = 256  # of a line's request as JSON: its prompt's or first messages' start
LOOKAHEAD = 64  # pending blocks searched for one of a replica's kinds


def affinity(line: JobLine) -> Hashable:
    """Lines with the same key probably share a prompt prefix: the start of their prompt or messages."""
    obj = line.obj
    if not isinstance(obj, dict):
        return None
    body = obj.get("body", obj) if line.openai else obj
    if not isinstance(body, dict):
        return None
    start = body.get("messages", body.get("prompt"))
    if isinstance(start, list) and start and all(isinstance(t, int) for t in start[:64]):
        return tuple(start[:64])  # token ids
    try:
        return json.dumps(start, ensure_ascii=False)[:AFFINITY_CHARS]
    except (TypeError, ValueError):
        return None


def _longest_first(line: JobLine) -> tuple[float, int]:
    obj = line.obj if isinstance(line.obj, dict) else {}
    body = obj.get("body", obj) if line.openai else obj
    wanted = body.get("max_tokens", body.get("max_completion_tokens")) if isinstance(body, dict) else None
    return (-wanted if isinstance(wanted, int | float) else -float("inf"), line.number)


class Dispatcher:
    """Blocks of lines for replicas, by `next_block(replica, busy)`, until every line `add`ed is answered (`done`)
    or out of tries (`lost`), and no more will be added (`close`)."""

    def __init__(self, block_lines: int):
        self.block_lines = max(1, block_lines)
        self.tries: collections.Counter[int] = collections.Counter()
        self.unfinished = 0
        self.closed = False
        self._pending: collections.deque[tuple[Hashable, list[JobLine]]] = collections.deque()
        self._suspects: collections.deque[JobLine] = collections.deque()
        self._kinds: dict[Hashable, Hashable] = {}  # a kind of line -> the replica that last took it
        self._alone: set[Hashable] = set()  # replicas running a suspect line, and nothing else until it ends

    def add(self, lines: list[JobLine]) -> None:
        """More of the job's lines (a window of them: blocks are made, and ordered, within each)."""
        self.unfinished += len(lines)
        blocks, by_kind = [], {}
        for line in lines:
            kind = affinity(line)
            group = by_kind.setdefault(kind, [])
            group.append(line)
            if len(group) == self.block_lines:
                blocks.append((kind, by_kind.pop(kind)))
        # What is left of each kind (most lines, where few start alike) goes out mixed, longest first (by
        # max_tokens), as one engine takes a whole job's lines: the job then ends with short lines on every
        # replica, not with one replica's long tail while the others wait.
        rest = sorted((line for group in by_kind.values() for line in group), key=_longest_first)
        blocks += [(None, rest[i : i + self.block_lines]) for i in range(0, len(rest), self.block_lines)]
        blocks.sort(key=lambda b: _longest_first(b[1][0]))
        self._pending.extend(blocks)

    def close(self) -> None:
        """No more lines will be added."""
        self.closed = True

    @property
    def pending(self) -> int:
        """Blocks waiting for a replica."""
        return len(self._pending) + len(self._suspects)

    @property
    def finished(self) -> bool:
        return self.closed and self.unfinished == 0

    def next_block(self, replica: Hashable, busy: bool) -> list[JobLine] | None:
        """A block for `replica` (`busy`: it has blocks in flight), or None: nothing for it now."""
        if replica in self._alone:
            return None
        if self._suspects:
            if busy:
                return None
            self._alone.add(replica)
            return [self._suspects.popleft()]
        if not self._pending:
            return None
        pick = 0
        for i, (kind, _) in enumerate(self._pending):
            if i == LOOKAHEAD:
                break
            if self._kinds.get(kind) == replica:
                pick = i
                break
        kind, block = self._pending[pick]
        del self._pending[pick]
        self._kinds[kind] = replica
        return block

    def done(self, replica: Hashable, answers: list[Answered]) -> None:
        self._alone.discard(replica)
        self.unfinished -= len(answers)

    def lost(self, replica: Hashable, block: list[JobLine]) -> list[Answered]:
        """`replica` died before answering the block: its lines are offered again, or, out of tries, answered with
        an error record (returned)."""
        self._alone.discard(replica)
        failed, again = [], []
        for line in block:
            self.tries[line.number] += 1
            if self.tries[line.number] >= MAX_TRIES:
                error = ReplicaLost(f"the replica answering this line died {MAX_TRIES} times")
                failed.append(Answered(line.number, records.failure(line, error), ok=False))
            elif self.tries[line.number] >= SUSPECT_AFTER:
                self._suspects.append(line)
            else:
                again.append(line)
        if again:
            self._pending.appendleft((None, again))
        self.unfinished -= len(failed)
        return failed
