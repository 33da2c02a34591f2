"""One replica of a distributed job: an engine answering blocks of job lines that arrive while it runs.

A driver (`jaxllama/ray.py`) hands a replica several blocks at once so that its engine never waits for the next;
each block's caller, on a thread of its own, gets that block's records when its last line ends, while the engine
goes on with the others' lines (one engine, one thread stepping it: `ReplicaLoop._loop`). The records are those
`run_job` writes for the same lines (`JobOnEngine`), so that a job answers alike on one process and on many.

A replica over several processes (one jax.distributed group: a model too large for a host) cannot take blocks as
they arrive, since each process would see them arrive at another step: every process answers the same blocks whole,
one after another (`LockstepLoop`), and so takes the same steps.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from jaxllama.batch.jobs import JobLine
from jaxllama.batch.runner import Answered, JobOnEngine, JobOptions, job_pipeline


@dataclasses.dataclass
class ReplicaStats:
    """What a replica has done: lines answered, their tokens, and the seconds its engine had lines to run."""

    lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0

    def count(self, a: Answered) -> None:
        self.lines += 1
        self.prompt_tokens += a.prompt_tokens
        self.completion_tokens += a.completion_tokens


class _Block:
    def __init__(self, lines: list[JobLine]):
        self.lines = lines
        self.left = len(lines)
        self.answers: list[Answered] = []
        self.done = threading.Event()


class ReplicaLoop:
    """An `LLM`'s engine answering blocks of job lines: `answer(lines)` may be called from several threads at
    once, each getting its own block's records; a thread steps the engine while any line is running."""

    def __init__(self, llm, options: JobOptions):
        self.llm = llm
        self.stats = ReplicaStats()
        self._arrived: queue.Queue[_Block] = queue.Queue()
        self._block_of: dict[int, _Block] = {}
        self._batch = JobOnEngine(llm, job_pipeline(llm, options), self._deliver)
        self._failure: BaseException | None = None
        threading.Thread(target=self._loop, name="jaxllama-replica", daemon=True).start()

    def answer(self, lines: list[JobLine]) -> list[Answered]:
        """The block's records, in the order its lines end. Raises what stopped the engine, if it stopped."""
        block = _Block(lines)
        self._arrived.put(block)
        while not block.done.wait(1.0):
            if self._failure is not None:
                raise RuntimeError("the replica's engine stopped") from self._failure
        return block.answers

    def _loop(self) -> None:
        try:
            while True:
                self._take(self._arrived.get())  # nothing to run: wait for a block
                busy = time.perf_counter()
                while True:
                    while not self._arrived.empty():
                        self._take(self._arrived.get_nowait())
                    if not self._batch.has_work():
                        break
                    self._batch.step()
                self.stats.busy_s += time.perf_counter() - busy
        except BaseException as e:  # every waiting block hears of it
            self._failure = e
            raise

    def _take(self, block: _Block) -> None:
        if not block.lines:
            block.done.set()
        for line in block.lines:
            self._block_of[line.number] = block
            self._batch.submit(line)  # a line that cannot run is delivered at once

    def _deliver(self, a: Answered) -> None:
        block = self._block_of.pop(a.number)
        block.answers.append(a)
        self.stats.count(a)
        block.left -= 1
        if block.left == 0:
            block.done.set()


class LockstepLoop:
    """An `LLM`'s engine over several processes answering blocks one at a time, each block's lines run to their ends
    before the next starts: given the same blocks in the same order, every process of the group takes the same
    steps. The caller orders the blocks (one at a time: `answer` is not to be called from two threads at once)."""

    def __init__(self, llm, options: JobOptions):
        self.llm, self.options = llm, options
        self.stats = ReplicaStats()

    def answer(self, lines: list[JobLine]) -> list[Answered]:
        answers: list[Answered] = []
        start = time.perf_counter()
        batch = JobOnEngine(self.llm, job_pipeline(self.llm, self.options), answers.append)
        for line in lines:
            batch.submit(line)
        batch.generate()
        self.stats.busy_s += time.perf_counter() - start
        for a in answers:
            self.stats.count(a)
        return answers
