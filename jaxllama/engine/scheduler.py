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
conversation) reuses their keys/values and computes only the rest (`prefix.py`); the reused count is reported as
`cached_tokens`. Every process of a multi-host run makes the same choices from the same requests.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxllama.engine import buckets
from jaxllama.engine.interface import FINISH, STOPPED, ModelRunnerInterface, PrefillRow, PromptLogprobs, Sampled
from jaxllama.engine.prefix import ResidentPrefixes, shared_prefixes
from jaxllama.engine.request import FinishReason, Request, SamplingParams, Timings, TokenConstraint, TopLogprobs, Update
from jaxllama.engine.stats import EngineStats
from jaxllama.errors import ContextLengthExceeded, InvalidParameter, InvalidRequest

# The fewest prompt tokens a step starts a prompt with: with less room left, it waits for the next step.
MIN_CHUNK = 16

# What a step plans to compute (`Scheduler._plan`): a chunk of a prompt computed in part, or a request taken and the
# most of its tokens computed now (None: all), with its token count.
_Planned = tuple[PrefillRow | tuple[Request, int | None], int]


@dataclasses.dataclass
class _Slot:
    request: Request
    length: int  # tokens in the cache after the last step (prompt + sampled - 1 pending input)
    generated: int = 0
    prefill_start: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    prompt_logprobs: PromptLogprobs | None = None  # of the prompt's tokens after the first, when computed


@dataclasses.dataclass
class _Partial:
    """A prompt computed in chunks (`EngineOptions.step_tokens`), holding its slot between them."""

    request: Request
    done: int  # its first `done` tokens are in the slot's cache
    prefill_start: float
    cached: int  # tokens its first chunk reused from another request's


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
        self.runner, self.step_tokens, self.clock = runner, step_tokens, clock
        self.slots, self.max_context, self.eos_ids = runner.slots, runner.max_context, tuple(runner.eos_ids)
        self.stats = stats or EngineStats()
        self.queue: collections.deque[Request] = collections.deque()
        self.active: dict[int, _Slot] = {}  # slot -> the request running there
        self.partial: dict[int, _Partial] = {}  # slot -> the prompt computed there in chunks, not yet running
        self.prefixes = ResidentPrefixes(self.slots, runner.reuse_multiple)
        self._kept = runner.max_context  # the positions the slots' caches keep (`_make_room`)
        self.ending: dict[int, tuple[FinishReason, str | None]] = {}  # slot -> why `finish` ends it
        self._stopping: set[int] = set()  # slots the device still runs for requests that ended

    # ---- public API -------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise a RequestError if the request can never run (the caller reports it for that request alone; its
        `SamplingParams` checked themselves when made)."""
        n, vocab = len(request.prompt), self.runner.vocab_size
        if n == 0:
            raise InvalidRequest("prompt is empty", "prompt")
        if n >= self.max_context:
            raise ContextLengthExceeded(
                f"prompt is {n} tokens, the context limit is {self.max_context} "
                "(prompt plus at least one generated token)"
            )
        bad = [t for t in request.prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        stop_ids = request.params.stop_token_ids
        if len(self.eos_ids) * (not request.params.ignore_eos) + len(stop_ids) > self.runner.max_stop_ids:
            extra = self.runner.max_stop_ids - len(self.eos_ids)
            raise InvalidParameter(f"stop_token_ids: at most {extra} extra stop token ids", "stop_token_ids")
        bad = [t for t in stop_ids if not 0 <= t < vocab]
        if bad:
            message = f"stop_token_ids={list(stop_ids)}: {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            raise InvalidParameter(message, "stop_token_ids")
        bad = [t for t, _ in request.params.logit_bias if not 0 <= t < vocab]
        if bad:
            message = f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            raise InvalidParameter(message, "logit_bias")

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
                out.append(_final_update(s, [], [], reason, stop_reason, self.clock()))
        self.ending.clear()
        return out

    def _admit(self) -> tuple[list[Update], bool]:
        """Start waiting requests in free slots, and go on with prompts computed in part -> (their updates, whether
        the step's decode ran with them: its running slots decoded in their last prefill call,
        `_prefill_and_decode`). While slots decode there, a step computes at most `step_tokens` tokens (`_budget`): a
        prompt past them is computed in chunks over the next steps, and requests that do not fit wait."""
        free = [i for i in range(self.slots) if i not in self.active and i not in self.partial]
        take = self._next_requests(len(free))
        if not take and not self.partial:
            return [], False
        left = self._budget()
        if take:
            left = self._compute_shared_prefixes(take, free, left)
        updates, groups = [], self._calls(self._plan(take, left))
        for i, group in enumerate(groups):
            rows = self._place_group(group, free)
            if i == len(groups) - 1 and self._joins_decode():
                return updates + self._prefill_and_decode(rows), True
            updates += self._prefill(rows)
        return updates, False

    def _budget(self) -> int | None:
        """The prompt tokens a step may compute: while slots decode in its prefill call, `step_tokens` less its decode
        rows (then a budget of whole packing steps pads nothing), at least a chunk's worth; None (no limit) while none
        decode there. With nothing decoding, every prompt that fits starts at once: holding prompts back to start a
        job's requests a step apart pays a pass over the weights for each step of the ramp and of the drain at its
        end (`jaxllama compile --job`, 64 lines of 1,024 + 1,024 on 64 slots of 8B on v5e:2x4: 8.1 s against 7.2 s
        at once), where prompts gain little from riding on decode steps: a step's weights' read leaves its matrix
        units time for ~240 tokens' products, about its own decode rows."""
        if not (self.active and self.runner.joins_decode):
            return None
        return max(self.step_tokens - len(self.active), MIN_CHUNK, self.runner.chunk_multiple)

    def _plan(self, take: list[Request], left: int | None) -> list[_Planned]:
        """What this step computes, as (a chunk, or (a request, the most of its tokens computed now)), with its token
        count: the next chunk of each prompt computed in part, then the requests taken, while the step's `left`
        prompt tokens last (None: no limit); a request left without room for a chunk worth a slot goes back to the
        queue's front, with those after it."""
        planned: list[_Planned] = []
        for slot in sorted(self.partial):
            row = self._next_chunk(slot, left)
            if row is not None:
                planned.append((row, len(row.tokens)))
                left = None if left is None else left - len(row.tokens)
        multiple = self.runner.chunk_multiple
        for k, r in enumerate(take):
            start = self.prefixes.best(r.prompt, logprobs=_wants_prompt_logprobs(r))[1]
            n = len(r.prompt) - start
            if left is not None and n > left:
                # A chunk of whole `multiple`s: a prompt whose log-probabilities are wanted computes its chunks' last
                # tokens again, off that grid, so there it is computed whole: in a step of its own where it must be.
                room = self._chunk_end(r.prompt, start, left) - start
                whole = multiple > 1 and _wants_prompt_logprobs(r)
                if (whole and planned) or (not whole and room < max(MIN_CHUNK, multiple)):
                    self.queue.extendleft(reversed(take[k:]))
                    break
                if whole:
                    planned.append(((r, None), n))
                    left = 0
                    continue
                n = room
            planned.append(((r, left), n))
            left = None if left is None else left - n
        return planned

    def _calls(self, planned: list[_Planned]) -> list[list]:
        """The planned items (`_plan`) as prefill calls: one per prompt bucket (its prompts padded to one length),
        or where the runner packs prompts, one per PACKED_TOKENS of them."""
        calls, packed, call = collections.defaultdict(list), 0, 0
        for item, n in planned:
            if self.runner.packs_prompts:
                if packed and packed + n > buckets.PACKED_TOKENS:
                    call, packed = call + 1, 0
                packed += n
                calls[0, call].append(item)
            else:
                calls[buckets.prompt_bucket(n, self.max_context), 0].append(item)
        return [group for _, group in sorted(calls.items())]

    def _place_group(self, group: list, free: list[int]) -> list[PrefillRow]:
        """The rows of one prefill call: its chunks of prompts computed in part as they are, and each request placed
        (`_place`; just before the call, when the cache holds what `prefixes` says), at most `limit` tokens of it."""
        requests = [item[0] for item in group if not isinstance(item, PrefillRow)]
        rows, call = [], self._prefill_call([(r.prompt, _wants_prompt_logprobs(r)) for r in requests])
        for item in group:
            if isinstance(item, PrefillRow):
                rows.append(item)
                continue
            r, limit = item
            source, start, slot = self._place(r.prompt, _wants_prompt_logprobs(r), free, call)
            free.remove(slot)
            end = self._chunk_end(r.prompt, start, limit)
            rows.append(PrefillRow(r, r.prompt[start:end], start, source, slot, final=end == len(r.prompt)))
        return rows

    def _next_chunk(self, slot: int, left: int | None) -> PrefillRow | None:
        """The next chunk of the prompt computed in part in `slot`, of at most `left` tokens (None: all the rest), or
        None where no progress fits. A prompt whose log-probabilities are wanted computes its last computed token
        again: that position gives the next token's log-probability."""
        p = self.partial[slot]
        prompt, start = p.request.prompt, p.done - _wants_prompt_logprobs(p.request)
        end = self._chunk_end(prompt, start, left)
        if end <= p.done:
            return None
        return PrefillRow(p.request, prompt[start:end], start, slot, slot, final=end == len(prompt))

    def _chunk_end(self, prompt: list[int], start: int, limit: int | None) -> int:
        """Where a prompt's chunk from `start` of at most `limit` tokens (None: all the rest) ends: the prompt's end,
        or a multiple of the runner's `chunk_multiple` before it."""
        end = len(prompt) if limit is None else min(len(prompt), start + limit)
        return end if end == len(prompt) else end - end % self.runner.chunk_multiple

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
        """Prompts admitted together that share a prefix no slot holds: compute it once, into a free slot that one
        of them will then take. Nested prefixes (a few-shot context, then each question's 4 answers) a level at a
        time, each level's rows starting from the slots the level before filled; while slots decode, only the levels
        that fit the step's `left` prompt tokens (None: no limit), the prompts then computing the rest themselves,
        in chunks. -> the prompt tokens the step has left."""
        for level in shared_prefixes([r.prompt for r in requests]):
            # Where a member wants its prompt's log-probabilities, the prefix's are computed with it and kept: the
            # members then reuse all but its last token, whose log-probability is not the one they need.
            wanted = []
            for members, n in level:
                prompt = requests[members[0]].prompt
                logprobs = any(_wants_prompt_logprobs(requests[i]) for i in members)
                if self.prefixes.best(prompt, logprobs=logprobs)[1] < n - logprobs:  # not held
                    wanted.append((prompt[:n], logprobs))
            rows: list[PrefillRow] = []
            idle, call = list(free), self._prefill_call(wanted)
            for prefix, logprobs in wanted[: len(free)]:
                source, start, slot = self._place(prefix, logprobs, idle, call)
                idle.remove(slot)
                params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0 if logprobs else None)
                rows.append(PrefillRow(Request(None, prefix, params), prefix[start:], start, source, slot))
            tokens = sum(len(r.tokens) for r in rows)
            if left is not None and tokens > left:
                break
            if rows:
                self._prefill(rows, sample=False)
                left = None if left is None else left - tokens
        return left

    def _prefill_call(self, prompts: list[tuple[list[int], bool]]) -> _PrefillCall:
        """A prefill call about to place rows for these (prompt, wants its log-probabilities)."""
        return _PrefillCall({self.prefixes.best(p, logprobs=logprobs)[0] for p, logprobs in prompts})

    def _place(self, prompt: list[int], logprobs: bool, free: list[int], call: _PrefillCall) -> tuple[int, int, int]:
        """(source, start, slot) of a prompt in the coming prefill call: the slot holding its longest prefix
        (`prefixes.best`; `logprobs`: with their log-probabilities) and the free slot it is computed in: that one
        where it is free, else the free one holding the least, sparing those the call's prompts reuse. A call's
        prefixes are copied one after another (`kvcache.copy_rows`), so a slot it copies into is not one it copies
        out of: where no free slot is left for the copy, the prompt is computed from its first token."""
        spare = lambda i: (i in call.reused, len(self.prefixes.tokens[i]))
        source, start = self.prefixes.best(prompt, frozenset(call.into), logprobs, free)
        if source in free:
            return source, start, source
        targets = [i for i in free if i not in call.out_of]
        if source is None or not targets:
            slot = min(free, key=spare)
            return slot, 0, slot
        slot = min(targets, key=spare)
        call.into.add(slot)
        call.out_of.add(source)
        return source, start, slot

    def _prefill(self, rows: list[PrefillRow], sample: bool = True) -> list[Update]:
        """Compute the rows and start them decoding; without `sample`, only fill the caches (a shared prefix)."""
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
        prompt_logprobs = self._prompt_logprobs(rows, out)
        for r, logprobs in zip(rows, prompt_logprobs, strict=True):
            self.prefixes.hold(r.slot, r.request.prompt[: r.start + len(r.tokens)], logprobs)
        if not sample:
            return []
        updates = []
        for i, r in enumerate(rows):
            self._stopping.discard(r.slot)  # refilled: the slot's new request must not be stopped
            earlier = self.partial.pop(r.slot, None)
            began, cached = (earlier.prefill_start, earlier.cached) if earlier else (start, r.start)
            if not r.final:
                self.partial[r.slot] = _Partial(r.request, r.start + len(r.tokens), began, cached)
                continue
            self.stats.cached_tokens += cached
            s = _Slot(r.request, len(r.request.prompt), 0, began, now, cached, prompt_logprobs=prompt_logprobs[i])
            self.active[r.slot] = s
            updates += self._advance(r.slot, s, out, i, first=True)
        return updates

    def _prompt_logprobs(self, rows: list[PrefillRow], out: Sampled | None) -> list[PromptLogprobs | None]:
        """The log-probabilities of each row's prompt tokens after the first, where the prefill computed them: those
        of a reused prefix as its source slot keeps them (read before any row's slot is held anew), then the
        prefill's own."""
        if out is None or out.prompt is None:
            return [None] * len(rows)
        whole = []
        for r, computed in zip(rows, out.prompt, strict=True):
            known = self.prefixes.logprobs[r.source] if r.start else None
            if r.start and (known is None or len(known) < r.start):
                whole.append(None)  # reused past what is known: the row did not ask (`best`)
            else:
                whole.append(PromptLogprobs.join([known[: r.start], computed]) if r.start else computed)
        return whole

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

    def _advance(self, slot: int, s: _Slot, out: Sampled, column: int, first: bool = False) -> list[Update]:
        """Take what the device sampled for slot (column `column` of `out`); end the request if the device says so.
        `first`: the prefill's token, whose update also says the prompt's size."""
        params = s.request.params
        steps = [i for i in range(out.emitted.shape[0]) if out.emitted[i, column]]
        if first and params.max_tokens == 0:  # the prompt alone was asked for: its sampled token is dropped
            steps = []
        tokens = [int(out.tokens[i, column]) for i in steps]
        logprobs = [float(out.logprobs[i, column]) for i in steps]
        extra = {}
        if params.top_logprobs and out.top_ids is not None:
            n = params.top_logprobs
            extra["top_logprobs"] = [_top(out.top_ids[i, column], out.top_logprobs[i, column], n) for i in steps]
        if first and params.prompt_logprobs is not None and s.prompt_logprobs is not None:
            p, n = s.prompt_logprobs, params.prompt_logprobs
            # Whole arrays to Python at once: an element at a time, a scoring job's 170k positions took seconds.
            ids, values = p.top_ids[:, :n].tolist(), p.top_logprobs[:, :n].tolist()
            extra["prompt_logprobs"] = [
                (lp, list(zip(i, v, strict=True))) for lp, i, v in zip(p.logprobs.tolist(), ids, values, strict=True)
            ]
        s.generated += len(tokens)
        s.tokens += tokens
        if first and params.max_tokens == 0:
            reason, code = "length", None
        else:
            code = int(out.finish[steps[-1], column]) if steps else None
            reason = FINISH[code] if steps else None
        constraint = s.request.constraint
        if constraint is not None:
            if reason is None:
                for t in tokens:
                    constraint.accept(t)
            # A matcher past its limits allows only an end-of-generation id: what it ended is an error, not "stop"
            error = constraint.error
            if error is not None or (reason is None and constraint.done):
                del self.active[slot]
                self._release(slot, s)
                if reason is None:  # ended here, not by the device: the device is told to stop the row
                    self._stopping.add(slot)
                if error is not None:
                    return [_final_update(s, tokens, logprobs, "error", None, self.clock(), error=error, **extra)]
                return [_final_update(s, tokens, logprobs, "stop", None, self.clock(), **extra)]
        if reason is None:
            return [Update(s.request.id, tokens, logprobs, **extra, **(_prompt_usage(s) if first else {}))]
        del self.active[slot]
        self._release(slot, s)
        stop_token = tokens[-1] if code == STOPPED else None
        return [_final_update(s, tokens, logprobs, reason, stop_token, self.clock(), **extra)]

    def _decode_columns(self, every: bool = True) -> list[int]:
        """The slots a decode call runs: every slot, or, when few are active, just those (padded with the
        out-of-range index `slots` to the next of ROW_BUCKETS): a step's cost grows with its rows. Without `every`,
        the active slots padded to as many as there are slots."""
        active = sorted(self.active)
        for size in buckets.ROW_BUCKETS:
            size = buckets.round_up(size, self.runner.row_multiple)
            if len(active) <= size < self.slots:
                return active + [self.slots] * (size - len(active))
        return list(range(self.slots)) if every else active + [self.slots] * (self.slots - len(active))

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
        """The function that gives each row's token bitmask (its constraint's; every token where it has none), or
        None when no row is constrained."""
        if not any(c is not None for c in constraints):
            return None
        words = (self.runner.vocab_size + 31) // 32

        def fill() -> np.ndarray:
            out = np.full((len(constraints), words), -1, np.int32)
            for row, c in zip(out, constraints, strict=True):
                if c is not None:
                    c.fill_mask(row)
            return out

        return fill

    def _column_masks(self, columns: list[int]) -> Callable[[], np.ndarray] | None:
        """`_masks` of a decode call's columns: each running slot's constraint (a padding column has none)."""
        return self._masks([self.active[c].request.constraint if c in self.active else None for c in columns])

    # ---- ending -----------------------------------------------------------------------------------

    def _release(self, slot: int, s: _Slot) -> None:
        """The slot is free; its cache keeps the sequence (all but the last token, never fed back), and the
        prompt's log-probabilities where they were computed."""
        self.prefixes.hold(slot, s.request.prompt + s.tokens[:-1], s.prompt_logprobs)


@dataclasses.dataclass
class _PrefillCall:
    """The slots of one prefill call: those holding a prefix its prompts reuse, and, as its rows are placed, those
    it copies a prefix into and out of (`Scheduler._place`)."""

    reused: set[int | None]
    into: set[int] = dataclasses.field(default_factory=set)
    out_of: set[int] = dataclasses.field(default_factory=set)


def _wants_prompt_logprobs(r: Request) -> bool:
    return r.params.prompt_logprobs is not None


def _top(ids, logprobs, n: int) -> TopLogprobs:
    """The first n (token id, log-probability) pairs of a position's most likely tokens."""
    return [(int(i), float(lp)) for i, lp in zip(ids[:n], logprobs[:n], strict=True)]


def _prompt_usage(s: _Slot) -> dict:
    return dict(prompt_tokens=len(s.request.prompt), cached_tokens=s.cached)


def _final_update(s: _Slot, tokens, logprobs, reason: FinishReason, stop_reason, now: float, **extra) -> Update:
    """A request's last update at `now`: its last tokens, why it ended, its usage and timings (`extra`: more
    `Update` fields)."""
    r = s.request
    decode_s = now - s.first_token if s.first_token else 0.0
    timings = Timings(
        queue_ms=1e3 * max(0.0, s.prefill_start - r.submitted),
        prefill_ms=1e3 * (s.first_token - s.prefill_start),
        ttft_ms=1e3 * (s.first_token - r.submitted),
        decode_ms=1e3 * decode_s,
        decode_tokens_per_s=(s.generated - 1) / decode_s if decode_s > 0 and s.generated > 1 else 0.0,
        total_ms=1e3 * (now - r.submitted),
    )
    usage = _prompt_usage(s)
    return Update(
        r.id, tokens, logprobs, reason, stop_reason, completion_tokens=s.generated, timings=timings, **usage, **extra
    )
