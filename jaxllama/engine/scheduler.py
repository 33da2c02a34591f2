"""Continuous batching: a queue of requests, a fixed number of decode slots, and the loop that keeps them full.
Plain Python over a model runner that keeps `interface.ModelRunnerInterface`; no jax here.

Each `step()` ends the requests `finish` was called for, admits waiting requests into free slots (the highest
`priority` first, then in order of arrival; one prefill call per prompt-length bucket, or where the runner packs
prompts, per PACKED_TOKENS of them), then runs one decode call for every running slot and returns the new tokens of
each request. Where the runner joins them (`joins_decode`), the decode step runs in the step's last prefill call,
and while slots decode a step computes at most `step_tokens` tokens, theirs and prompts': a longer prompt is computed
in chunks over several steps (`partial`), so that it delays the running requests by a chunk, not by the whole
prompt. A
finished sequence frees its slot for the next request at once; nobody waits for the longest one.

A prompt that starts with tokens some slot's cache already holds (a shared system prompt, the earlier turns of a
conversation), or over a paged cache that the pool still keeps from a slot since refilled, reuses their keys/values
and computes only the rest (`prefix.py`, `pages.py`); the reused count is reported as `cached_tokens`. Every
process of a multi-host run makes the same choices from the same requests.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxllama.engine import buckets
from jaxllama.engine.interface import ModelRunnerInterface, PrefillRow, Sampled
from jaxllama.engine.prefix import ResidentPrefixes
from jaxllama.engine.request import FinishReason, Request, TokenConstraint, Update, check_request, token_masks
from jaxllama.engine.slot import HOST, Partial, Slot
from jaxllama.engine.stats import EngineStats
from jaxllama.engine.step_plan import StepPlanner


class Scheduler:
    """Generates for many requests at once on one model runner. Not thread-safe: one thread drives `step()`."""

    def __init__(
        self,
        runner: ModelRunnerInterface,
        stats: EngineStats | None = None,
        step_tokens: int = buckets.STEP_TOKENS,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`clock`: seconds, for timings and statistics (a job's prediction runs on the clock of its programs' costs,
        `engine/job_clock.py`)."""
        self.runner, self.clock = runner, clock
        self.slots, self.max_context = runner.slots, runner.max_context
        self.stats = stats or EngineStats()
        self.queue: collections.deque[Request] = collections.deque()
        self.active: dict[int, Slot] = {}  # slot -> the request running there
        self.partial: dict[int, Partial] = {}  # slot -> the prompt computed there in chunks, not yet running
        self.prefixes = ResidentPrefixes(self.slots, runner.reuse_multiple, runner.pages)
        self.planner = StepPlanner(runner, self.prefixes, step_tokens)
        self._kept = runner.max_context  # the positions the slots' caches keep (`_make_room`)
        self.ending: dict[int, tuple[FinishReason, str | None]] = {}  # slot -> why `finish` ends it
        self._stopping: set[int] = set()  # slots the device still runs for requests that ended
        # Slots whose cache holds positions computed since the device last started a row there (a shared prefix
        # computed alone, a prompt's chunks): a decode call must not run them, as its stale row there would write
        # its keys and values over what they hold (`_decode_columns`).
        self._unsynced: set[int] = set()

    @property
    def step_tokens(self) -> int:
        """The tokens a step computes while slots decode (`StepPlanner.budget`)."""
        return self.planner.step_tokens

    @step_tokens.setter
    def step_tokens(self, tokens: int) -> None:
        self.planner.step_tokens = tokens

    # ---- public API -------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise a RequestError if the request can never run on this runner (`request.check_request`)."""
        check_request(request, self.runner)

    def add(self, request: Request) -> None:
        """Queue a request (a RequestError if it can never run). A max_tokens past the context or a top_k past the
        vocabulary means the limit: they are capped to it (the device holds them as int32)."""
        self.check(request)
        p = request.params
        max_tokens, top_k = min(p.max_tokens, self.max_context), min(p.top_k, self.runner.vocab_size)
        if (max_tokens, top_k) != (p.max_tokens, p.top_k):
            capped = dict(max_tokens=max_tokens, top_k=top_k, min_tokens=min(p.min_tokens, max_tokens))
            request = dataclasses.replace(request, params=dataclasses.replace(p, **capped))
        self.queue.append(request)

    def finish(self, request_id, reason: FinishReason = "cancelled", stop_reason: str | None = None) -> None:
        """End a request for `reason` (a stop string found in its text: "stop" and that string; its client gone:
        "cancelled"). A running one ends with an update carrying the reason at the next step, and its slot is
        freed; one still waiting for a slot is dropped at once, with no update."""
        for i, r in enumerate(self.queue):
            if r.id == request_id:
                del self.queue[i]
                return
        for slot, p in self.partial.items():
            if p.request.id == request_id:
                del self.partial[slot]  # its slot keeps the prompt's computed part (`prefixes`)
                return
        for slot, s in self.active.items():
            if s.request.id == request_id:
                self.ending.setdefault(slot, (reason, stop_reason))

    def is_waiting(self, request_id) -> bool:
        """Whether the request has sampled nothing yet: queued, or its prompt computed in part."""
        return any(r.id == request_id for r in self.queue) or any(
            p.request.id == request_id for p in self.partial.values()
        )

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self.active) + len(self.partial)

    def has_work(self) -> bool:
        return bool(self.queue or self.active or self.partial)

    def generate(self, requests: Iterable[Request]) -> Iterator[Update]:
        """Run requests to completion, yielding updates as they come."""
        for r in requests:
            self.add(r)
        while self.has_work():
            yield from self.step()

    def step(self) -> list[Update]:
        updates = self._end_finished()
        admitted, decoded = self._admit()
        updates += admitted
        if self.active and not decoded:
            updates += self._decode()
        return updates

    # ---- admission --------------------------------------------------------------------------------

    def _end_finished(self) -> list[Update]:
        """The updates of the requests `finish` ended; their slots are stopped on the device at the next decode."""
        out = []
        for slot, (reason, stop_reason) in sorted(self.ending.items()):
            if slot in self.active:
                s = self.active.pop(slot)
                self._release(slot, s)
                self._stopping.add(slot)
                out.append(s.final([], [], reason, stop_reason, self.clock()))
        self.ending.clear()
        return out

    def _admit(self) -> tuple[list[Update], bool]:
        """Start waiting requests in free slots, and go on with prompts computed in part -> (their updates, whether
        the step's decode ran with them: its running slots decoded in their last prefill call,
        `_prefill_and_decode`). While slots decode there, a step computes at most `step_tokens` tokens
        (`StepPlanner.budget`): a prompt past them is computed in chunks over the next steps, and requests that do
        not fit wait."""
        free = [i for i in range(self.slots) if i not in self.active and i not in self.partial]
        take = self._next_requests(len(free))
        if not take and not self.partial:
            return [], False
        left = self.planner.budget(len(self.active))
        if take:
            left = self._compute_shared_prefixes(take, free, left)
        planned, back = self.planner.plan(take, self.partial, left)
        self.queue.extendleft(reversed(back))
        updates, groups = [], self.planner.calls(planned)
        for i, group in enumerate(groups):
            rows = self.planner.place_group(group, free)
            if i == len(groups) - 1 and self._joins_decode():
                return updates + self._prefill_and_decode(rows), True
            updates += self._prefill(rows)
        return updates, False

    def _joins_decode(self) -> bool:
        """Whether the step's decode may run in its prefill call: where the runner joins them and some slot is
        running. (A constrained row's mask, known before the call, goes with it, as in a decode step of one token.)"""
        return self.runner.joins_decode and bool(self.active)

    def _next_requests(self, n: int) -> list[Request]:
        """Take up to n queued requests: the highest priority first, in order of arrival among equals."""
        if len({r.priority for r in self.queue}) <= 1:
            return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
        chosen = set(heapq.nsmallest(n, range(len(self.queue)), key=lambda i: (-self.queue[i].priority, i)))
        take = [r for i, r in enumerate(self.queue) if i in chosen]
        self.queue = collections.deque(r for i, r in enumerate(self.queue) if i not in chosen)
        return sorted(take, key=lambda r: -r.priority)

    def _compute_shared_prefixes(self, requests: list[Request], free: list[int], left: int | None) -> int | None:
        """Compute the prefixes the requests admitted together share and no slot holds
        (`StepPlanner.shared_prefix_levels`), a level at a time; while slots decode, only the levels that fit the
        step's `left` prompt tokens (None: no limit), the prompts then computing the rest themselves, in chunks. ->
        the prompt tokens the step has left."""
        for rows in self.planner.shared_prefix_levels(requests, free):
            tokens = sum(len(r.tokens) for r in rows)
            if left is not None and tokens > left:
                break
            if rows:
                self._prefill(rows, sample=False)
                left = None if left is None else left - tokens
        return left

    def _prefill(self, rows: list[PrefillRow], sample: bool = True) -> list[Update]:
        """Compute the rows and start them decoding; without `sample`, only fill the caches (a shared prefix)."""
        self._assign(rows)
        self._make_room(self._positions(rows))
        compiling, start = self.stats.compile_s, self.clock()
        masks = self._masks([r.request.constraint for r in rows]) if sample else None
        out = self.runner.prefill(rows, sample, masks) if masks else self.runner.prefill(rows, sample)
        now = self.clock()
        self._count_prefill(rows, now - start - (self.stats.compile_s - compiling))
        return self._start(rows, out, start, now, sample)

    def _prefill_and_decode(self, rows: list[PrefillRow]) -> list[Update]:
        """`_prefill(rows)` and `_decode()` as one call of the runner (one pass over the weights for both): the
        running slots advance by a token while the rows' prompts are computed; the rows start decoding next step."""
        self._assign(rows)
        self._make_room(self._positions(rows))
        columns = self._decode_columns(every=False)  # never a slot the rows are computed into
        cancelled, self._stopping = sorted(self._stopping), set()
        params = [s.request.params for s in self.active.values()]
        masks = self._masks([r.request.constraint for r in rows])
        decode_masks = self._column_masks(columns)
        compiling, start = self.stats.compile_s, self.clock()
        started, decoded = self.runner.prefill_and_decode(rows, columns, params, cancelled, masks, decode_masks)
        now = self.clock()
        # The call's time counts as prefill and decode by their shares of its tokens.
        seconds, prompt_tokens = now - start - (self.stats.compile_s - compiling), sum(len(r.tokens) for r in rows)
        prefill_share = prompt_tokens / (prompt_tokens + len(self.active))
        self._count_prefill(rows, seconds * prefill_share)
        updates = self._start(rows, started, start, now)
        return updates + self._decoded(columns, decoded, seconds * (1 - prefill_share))

    def _assign(self, rows: list[PrefillRow]) -> None:
        """Over a paged cache, give the rows their pages as soon as they are placed, before anything else takes a
        page: the prefixes they were placed over, which the pool may hold only as free cached pages, are theirs
        then, and a slot a row refills lets its old pages go before the running slots' next ones are taken."""
        if self.runner.pages is not None:
            self.runner.pages.assign_rows(rows)

    def _positions(self, rows: list[PrefillRow]) -> int:
        """The cache positions a prefill of these rows writes: each row's prompt, padded to one bucket unless the
        runner packs prompts (a packed chunk that starts past its slot's first positions would overshoot)."""
        if self.runner.packs_prompts:
            return max(r.start + len(r.tokens) for r in rows)
        q = buckets.prompt_bucket(max(len(r.tokens) for r in rows), self.max_context)
        return max(r.start + q for r in rows)

    def _count_prefill(self, rows: list[PrefillRow], seconds: float) -> None:
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += sum(len(r.tokens) for r in rows)
        self.stats.prefill_s += seconds

    def _start(self, rows: list[PrefillRow], out: Sampled | None, start: float, now: float, sample=True) -> list:
        """The slots hold the rows' prompts, computed by a call from `start` to `now` that sampled `out`; with
        `sample`, the rows run from their first tokens on -> their updates."""
        prompt_logprobs = self.prefixes.prompt_logprobs(rows, out)
        for r, logprobs in zip(rows, prompt_logprobs, strict=True):
            self.prefixes.hold(r.slot, r.request.prompt[: r.start + len(r.tokens)], logprobs)
            if sample and r.final:  # the device starts a row there
                self._unsynced.discard(r.slot)
                self._stopping.discard(r.slot)  # refilled: the slot's new request must not be stopped
            else:
                self._unsynced.add(r.slot)
        if not sample:
            return []
        updates = []
        for i, r in enumerate(rows):
            earlier = self.partial.pop(r.slot, None)
            began, cached = (earlier.prefill_start, earlier.cached) if earlier else (start, r.start)
            if not r.final:
                self.partial[r.slot] = Partial(r.request, r.start + len(r.tokens), began, cached)
                continue
            self.stats.cached_tokens += cached
            s = Slot(r.request, len(r.request.prompt), 0, began, now, cached, prompt_logprobs=prompt_logprobs[i])
            self.active[r.slot] = s
            updates += self._advance(r.slot, s, out, i, first=True)
        return updates

    # ---- decoding ---------------------------------------------------------------------------------

    def _decode(self) -> list[Update]:
        self._make_room(0)
        columns = self._decode_columns()
        cancelled, self._stopping = sorted(self._stopping), set()
        compiling, start = self.stats.compile_s, self.clock()
        params = [s.request.params for s in self.active.values()]
        # A constrained row needs its mask before each token: while one runs, calls advance one step.
        masks = self._column_masks(columns)
        if masks:
            out = self.runner.generate(columns, params, cancelled, masks)
        else:
            out = self.runner.generate(columns, params, cancelled)
        return self._decoded(columns, out, self.clock() - start - (self.stats.compile_s - compiling))

    def _decoded(self, columns: list[int], out: Sampled, seconds: float) -> list[Update]:
        """What a decode call of `columns` that took `seconds` sampled (`out`), as the running requests' updates."""
        self.stats.decode_s += seconds
        self.stats.decode_steps += out.tokens.shape[0]
        self.stats.slot_steps += int(out.emitted.sum())
        updates = []
        for column, slot in enumerate(columns):
            if slot in self.active:
                s = self.active[slot]
                before = s.generated
                updates += self._advance(slot, s, out, column)
                self.stats.generated_tokens += s.generated - before
        return updates

    def _advance(self, slot: int, s: Slot, out: Sampled, column: int, first: bool = False) -> list[Update]:
        """Take what the device sampled for slot (`Slot.take`); free the slot where the request ended (and where the
        host ended it, tell the device to stop its row at the next decode)."""
        update, ended = s.take(out, column, first, self.clock)
        if ended is not None:
            del self.active[slot]
            self._release(slot, s)
            if ended == HOST:
                self._stopping.add(slot)
        return [update]

    def _decode_columns(self, every: bool = True) -> list[int]:
        """The slots a decode call runs: every slot, or, when few are active, just those (padded with the
        out-of-range index `slots` to the next of ROW_BUCKETS): a step's cost grows with its rows. Without `every`,
        or while some slot is unsynced (a free slot's row would write over what was computed there since), the
        active slots padded to as many as there are slots."""
        active = sorted(self.active)
        for size in buckets.ROW_BUCKETS:
            size = buckets.round_up(size, self.runner.row_multiple)
            if len(active) <= size < self.slots:
                return active + [self.slots] * (size - len(active))
        if every and not self._unsynced:
            return list(range(self.slots))
        return active + [self.slots] * (self.slots - len(active))

    def _make_room(self, needed: int) -> None:
        """The cache holds `needed` positions for the rows about to be computed and every active sequence's next
        decode call; what the slots held past what it keeps is forgotten."""
        steps = self.runner.decode_steps
        lengths = {slot: s.length + s.generated + steps for slot, s in self.active.items()}
        lengths |= {slot: p.done for slot, p in self.partial.items()}
        start = self.clock()
        kept = self.runner.make_room(needed, lengths)
        if kept < self._kept:
            self.prefixes.truncate(kept)
        self._kept = kept
        self.stats.decode_s += self.clock() - start

    def _masks(self, constraints: list[TokenConstraint | None]) -> Callable[[], np.ndarray] | None:
        return token_masks(constraints, self.runner.vocab_size)

    def _column_masks(self, columns: list[int]) -> Callable[[], np.ndarray] | None:
        """`_masks` of a decode call's columns: each running slot's constraint (a padding column has none)."""
        return self._masks([self.active[c].request.constraint if c in self.active else None for c in columns])

    # ---- ending -----------------------------------------------------------------------------------

    def _release(self, slot: int, s: Slot) -> None:
        """The slot is free; its cache keeps the sequence (all but the last token, never fed back), and the
        prompt's log-probabilities where they were computed."""
        self.prefixes.hold(slot, s.request.prompt + s.tokens[:-1], s.prompt_logprobs)
