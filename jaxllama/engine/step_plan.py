"""What a step computes of the waiting prompts: which requests start, how many of their tokens (a step's token
budget, a prompt past it computed in chunks), in which prefill calls (one per prompt-length bucket, or per
PACKED_TOKENS where the runner packs prompts), in which slots, and from which cached prefix. Planning only: the
scheduler keeps the slots' state and runs the calls; nothing here calls the runner.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

from jaxllama.engine import buckets
from jaxllama.engine.interface import CACHED, ModelRunnerInterface, PrefillRow
from jaxllama.engine.prefix import MIN_REUSE, ResidentPrefixes, shared_prefixes
from jaxllama.engine.request import Request, SamplingParams
from jaxllama.engine.slot import Partial

# The fewest prompt tokens a step starts a prompt with: with less room left, it waits for the next step.
MIN_CHUNK = 16

# What a step plans to compute (`StepPlanner.plan`): a chunk of a prompt computed in part, or a request taken and the
# most of its tokens computed now (None: all), with its token count.
Planned = tuple[PrefillRow | tuple[Request, int | None], int]


class StepPlanner:
    """Plans the prompt work of a scheduler's steps over its runner's shapes and the prefixes its slots hold."""

    def __init__(self, runner: ModelRunnerInterface, prefixes: ResidentPrefixes, step_tokens: int):
        self.runner, self.prefixes, self.step_tokens = runner, prefixes, step_tokens
        self.max_context = runner.max_context

    def budget(self, decoding: int) -> int | None:
        """The prompt tokens a step may compute while `decoding` slots decode in its prefill call: `step_tokens` less
        its decode rows (then a budget of whole packing steps pads nothing), at least a chunk's worth; None (no
        limit) while none decode there. With nothing decoding, every prompt that fits starts at once: holding
        prompts back to start a job's requests a step apart pays a pass over the weights for each step of the ramp
        and of the drain at its end (`jaxllama compile --job`, 64 lines of 1,024 + 1,024 on 64 slots of 8B on
        v5e:2x4: 8.1 s against 7.2 s at once), where prompts gain little from riding on decode steps: a step's
        weights' read leaves its matrix units time for ~240 tokens' products, about its own decode rows."""
        if not (decoding and self.runner.joins_decode):
            return None
        return max(self.step_tokens - decoding, MIN_CHUNK, self.runner.chunk_multiple)

    def plan(
        self, take: list[Request], partial: dict[int, Partial], left: int | None
    ) -> tuple[list[Planned], list[Request]]:
        """What this step computes, as (a chunk, or (a request, the most of its tokens computed now)), with its token
        count: the next chunk of each prompt computed in part, then the requests taken, while the step's `left`
        prompt tokens last (None: no limit) -> (that, the requests taken that wait: a request left without room for
        a chunk worth a slot, and those after it)."""
        planned: list[Planned] = []
        for slot in sorted(partial):
            row = self._next_chunk(slot, partial[slot], left)
            if row is not None:
                planned.append((row, len(row.tokens)))
                left = None if left is None else left - len(row.tokens)
        multiple = self.runner.chunk_multiple
        for k, r in enumerate(take):
            start = self.prefixes.best(r.prompt, logprobs=wants_prompt_logprobs(r))[1]
            n = len(r.prompt) - start
            if left is not None and n > left:
                # A chunk of whole `multiple`s: a prompt whose log-probabilities are wanted computes its chunks' last
                # tokens again, off that grid, so there it is computed whole: in a step of its own where it must be.
                room = self._chunk_end(r.prompt, start, left) - start
                whole = multiple > 1 and wants_prompt_logprobs(r)
                if (whole and planned) or (not whole and room < max(MIN_CHUNK, multiple)):
                    return planned, take[k:]
                if whole:
                    planned.append(((r, None), n))
                    left = 0
                    continue
                n = room
            planned.append(((r, left), n))
            left = None if left is None else left - n
        return planned, []

    def calls(self, planned: list[Planned]) -> list[list]:
        """The planned items as prefill calls: one per prompt bucket (its prompts padded to one length), or where
        the runner packs prompts, one per PACKED_TOKENS of them."""
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

    def place_group(self, group: list, free: list[int]) -> list[PrefillRow]:
        """The rows of one prefill call: its chunks of prompts computed in part as they are, and each request placed
        (`_place`; just before the call, when the cache holds what `prefixes` says), at most `limit` tokens of it;
        the slots it takes leave `free`."""
        requests = [item[0] for item in group if not isinstance(item, PrefillRow)]
        rows, call = [], self._prefill_call([(r.prompt, wants_prompt_logprobs(r)) for r in requests])
        for item in group:
            if isinstance(item, PrefillRow):
                rows.append(item)
                continue
            r, limit = item
            source, start, slot = self._place(r.prompt, wants_prompt_logprobs(r), free, call)
            free.remove(slot)
            end = self._chunk_end(r.prompt, start, limit)
            rows.append(PrefillRow(r, r.prompt[start:end], start, source, slot, final=end == len(r.prompt)))
        return rows

    def shared_prefix_levels(self, requests: list[Request], free: list[int]) -> Iterator[list[PrefillRow]]:
        """Prompts admitted together that share a prefix no slot holds: the rows that compute it once, into a free
        slot that one of them will then take. Nested prefixes (a few-shot context, then each question's 4 answers)
        a level at a time: each level's rows are placed when the caller asks for them, after it computed the level
        before, so that they start from the slots that level filled."""
        for level in shared_prefixes([r.prompt for r in requests]):
            # Where a member wants its prompt's log-probabilities, the prefix's are computed with it and kept: the
            # members then reuse all but its last token, whose log-probability is not the one they need.
            # A prefix is reused in whole `multiple`s (a paged cache's pages): its tokens past the last are computed
            # by each member, and counting them held or not would compute the prefix again at every step.
            wanted, multiple = [], self.prefixes.multiple
            for members, n in level:
                prompt = requests[members[0]].prompt
                logprobs = any(wants_prompt_logprobs(requests[i]) for i in members)
                n -= n % multiple
                held = (n - logprobs) // multiple * multiple  # the most `best` gives where it is held
                if n >= MIN_REUSE and self.prefixes.best(prompt, logprobs=logprobs)[1] < held:
                    wanted.append((prompt[:n], logprobs))
            rows: list[PrefillRow] = []
            idle, call = list(free), self._prefill_call(wanted)
            for prefix, logprobs in wanted[: len(free)]:
                source, start, slot = self._place(prefix, logprobs, idle, call)
                idle.remove(slot)
                params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0 if logprobs else None)
                rows.append(PrefillRow(Request(None, prefix, params), prefix[start:], start, source, slot))
            yield rows

    def _next_chunk(self, slot: int, p: Partial, left: int | None) -> PrefillRow | None:
        """The next chunk of the prompt computed in part in `slot`, of at most `left` tokens (None: all the rest), or
        None where no progress fits. A prompt whose log-probabilities are wanted computes its last computed token
        again: that position gives the next token's log-probability."""
        prompt, start = p.request.prompt, p.done - wants_prompt_logprobs(p.request)
        end = self._chunk_end(prompt, start, left)
        if end <= p.done:
            return None
        return PrefillRow(p.request, prompt[start:end], start, slot, slot, final=end == len(prompt))

    def _chunk_end(self, prompt: list[int], start: int, limit: int | None) -> int:
        """Where a prompt's chunk from `start` of at most `limit` tokens (None: all the rest) ends: the prompt's end,
        or a multiple of the runner's `chunk_multiple` before it."""
        end = len(prompt) if limit is None else min(len(prompt), start + limit)
        return end if end == len(prompt) else end - end % self.runner.chunk_multiple

    def _prefill_call(self, prompts: list[tuple[list[int], bool]]) -> _PrefillCall:
        """A prefill call about to place rows for these (prompt, wants its log-probabilities)."""
        return _PrefillCall({self.prefixes.best(p, logprobs=logprobs)[0] for p, logprobs in prompts})

    def _place(self, prompt: list[int], logprobs: bool, free: list[int], call: _PrefillCall) -> tuple[int, int, int]:
        """(source, start, slot) of a prompt in the coming prefill call: the slot holding its longest prefix
        (`prefixes.best`; `logprobs`: with their log-probabilities) and the free slot it is computed in: that one
        where it is free, else the free one holding the least, sparing those the call's prompts reuse. A call's
        prefixes are copied one after another (`kvcache.copy_rows`), so a slot it copies into is not one it copies
        out of: where no free slot is left for the copy, the prompt is computed from its first token. A prefix the
        pool caches (`CACHED`) is copied nowhere: any free slot takes its pages."""
        spare = lambda i: (i in call.reused, len(self.prefixes.tokens[i]))
        source, start = self.prefixes.best(prompt, frozenset(call.into), logprobs, free)
        if source in free:
            return source, start, source
        if source == CACHED:  # a paged pool's pages, taken by reference: nothing is copied
            return source, start, min(free, key=spare)
        targets = [i for i in free if i not in call.out_of]
        if source is None or not targets:
            slot = min(free, key=spare)
            return slot, 0, slot
        slot = min(targets, key=spare)
        call.into.add(slot)
        call.out_of.add(source)
        return source, start, slot


@dataclasses.dataclass
class _PrefillCall:
    """The slots of one prefill call: those holding a prefix its prompts reuse, and, as its rows are placed, those
    it copies a prefix into and out of (`StepPlanner._place`)."""

    reused: set[int | None]
    into: set[int] = dataclasses.field(default_factory=set)
    out_of: set[int] = dataclasses.field(default_factory=set)


def wants_prompt_logprobs(r: Request) -> bool:
    return r.params.prompt_logprobs is not None
