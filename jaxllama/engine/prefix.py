"""Prefix reuse: which tokens' keys and values each decode slot holds, and which slot a new prompt can
start from.

A slot's cache keeps the keys/values of its sequence after the request is gone, until the slot is
refilled. A new prompt that shares a prefix with any slot's sequence (a system prompt, the earlier turns of
a conversation) copies those positions from that slot and computes only the rest. Over a paged cache a prompt
also finds the full pages of sequences whose slots were refilled since, as long as the pool keeps them
(`pages.PageTable.cached`), and shares them by reference. Prompts admitted together that share a prefix nothing
holds get it computed once (`shared_prefixes`).

A slot also keeps the log-probabilities of its prompt's tokens when its request asked for them
(`interface.PromptLogprobs`): a prompt that wants its own reuses a prefix only as far as they are known, so that
scoring many continuations of one context computes the context once and still reports every position.

Plain Python over token lists: every process of a multi-host run makes the same choices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from jaxllama.engine.interface import CACHED, PrefillRow, PromptLogprobs, Sampled
from jaxllama.engine.pages import PageTable

MIN_REUSE = 8  # tokens: below this, computing the prefix again costs less than the bookkeeping
# Tokens a prompt computes again rather than copy a longer prefix from a busy slot into its own: a few tokens' compute
# costs about what copying a few hundred positions' keys and values does.
FREE_SLACK = 8


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class ResidentPrefixes:
    """Per slot: the token ids whose keys/values sit at positions 0.. of that slot's cache, and the
    log-probabilities known of its tokens 1, 2, ... (a `PromptLogprobs`, or None). A prefix is reused in multiples
    of `multiple` tokens (a paged cache shares whole pages: `engine/pages.py`). Over a paged cache (`pool`) the
    pool's cached pages are a source too: what slots held before they were refilled, until their pages are given
    out again."""

    def __init__(self, slots: int, multiple: int = 1, pool: PageTable | None = None):
        self.multiple, self.pool = multiple, pool
        self.tokens = [np.zeros(0, np.int32) for _ in range(slots)]
        self.logprobs: list[PromptLogprobs | None] = [None] * slots

    def hold(self, slot: int, tokens: Sequence[int], logprobs: PromptLogprobs | None = None) -> None:
        """The slot's cache now holds exactly these tokens' keys/values; `logprobs`: those of its tokens from the
        second on, as far as they are known. Over a paged cache the slot's full pages are cached in the pool
        under these tokens (`PageTable.register`)."""
        self.tokens[slot] = np.asarray(tokens, np.int32)
        self.logprobs[slot] = logprobs
        if self.pool is not None:
            self.pool.register(slot, self.tokens[slot])

    def truncate(self, length: int) -> None:
        """The cache was cut to `length` positions."""
        self.tokens = [t[:length] for t in self.tokens]
        self.logprobs = [None if lp is None else lp[: max(0, length - 1)] for lp in self.logprobs]

    def prompt_logprobs(self, rows: Sequence[PrefillRow], out: Sampled | None) -> list[PromptLogprobs | None]:
        """The log-probabilities of each prefill row's prompt tokens after the first, where the prefill (`out`)
        computed them: those of a reused prefix as its source slot keeps them (read before any row's slot is held
        anew), then the prefill's own."""
        if out is None or out.prompt is None:
            return [None] * len(rows)
        whole = []
        for r, computed in zip(rows, out.prompt, strict=True):
            known = self.logprobs[r.source] if r.start and r.source != CACHED else None
            if r.start and (known is None or len(known) < r.start):
                whole.append(None)  # reused past what is known: the row did not ask (`best`)
            else:
                whole.append(PromptLogprobs.join([known[: r.start], computed]) if r.start else computed)
        return whole

    def best(
        self,
        prompt: Sequence[int],
        exclude: frozenset[int] = frozenset(),
        logprobs: bool = False,
        free: Collection[int] = (),
    ) -> tuple[int | None, int]:
        """(slot, n): the slot holding the longest prefix of `prompt` and its length, at most len(prompt) - 1
        (the last prompt token is always computed: it gives the first token's logits); with `logprobs`, such that
        the slot also knows the log-probability of the prompt's token n (that of the same token after the same
        tokens: n + 1 tokens in common), so that the prompt's own come from it up to token n and from the prefill
        after; n a multiple of `multiple`; (None, 0) if no slot holds at least MIN_REUSE tokens of it. A slot of
        `free` (which the prompt may then take, computing in place instead of copying the prefix to another slot) is
        chosen where it holds at least all but FREE_SLACK tokens of the longest. Where the pool caches more of it
        than the slot so chosen holds (and its log-probabilities are not wanted, which pages do not keep):
        (CACHED, n)."""
        slot, n = self._best_slot(prompt, exclude, logprobs, free)
        if self.pool is not None and not logprobs:
            cached = len(self.pool.cached(prompt, len(prompt) - 1)) * self.pool.page_size
            if cached > max(n, MIN_REUSE - 1):
                return CACHED, cached
        return slot, n

    def _best_slot(
        self, prompt: Sequence[int], exclude: frozenset[int], logprobs: bool, free: Collection[int]
    ) -> tuple[int | None, int]:
        p = np.asarray(prompt, np.int32)
        best = {False: (None, MIN_REUSE - 1), True: (None, MIN_REUSE - 1)}  # busy or free: (slot, n)
        for slot, held in enumerate(self.tokens):
            if logprobs:
                known = self.logprobs[slot]
                held = held[: 0 if known is None else len(known) + 1]  # tokens 0..k, token k's known
            is_free = slot in free
            if slot in exclude or len(held) <= best[is_free][1]:
                continue
            n = min(common_prefix(p, held) - logprobs, len(prompt) - 1)
            n -= n % self.multiple
            if n > best[is_free][1]:
                best[is_free] = slot, n
        (busy, n), (idle, m) = best[False], best[True]
        if idle is not None and (busy is None or m >= n - FREE_SLACK):
            return idle, m
        return (busy, n) if busy is not None else (None, 0)


def shared_prefixes(prompts: Sequence[Sequence[int]], min_length: int = 16) -> list[list[tuple[list[int], int]]]:
    """Groups of prompts (indices, prefix length) that share a prefix of at least `min_length` tokens, shorter than
    each of them, so that computing it once for the group pays; nested, as the prompts' tree of common prefixes is:
    a group's members that share a prefix at least `min_length` tokens longer (the 4 answers to one question of a
    few-shot context) form a group of their own. Returned by depth: each group of level i + 1 lies within one of
    level i, so a level's prefixes can be computed from the one before."""
    arrays = [np.asarray(p, np.int32) for p in prompts]
    levels: list[list[tuple[list[int], int]]] = []

    def split(members: list[int], depth: int, base: int, level: int) -> None:
        """`members` share their first `depth` tokens; `base`: the prefix their enclosing group computes."""
        by_next: dict[int, list[int]] = {}
        for i in members:
            if len(arrays[i]) > depth + 1:  # a prefix stops short of each prompt's last token
                by_next.setdefault(int(arrays[i][depth]), []).append(i)
        for group in by_next.values():
            if len(group) < 2:
                continue
            shortest = min(len(arrays[i]) for i in group)
            rows = np.stack([arrays[i][:shortest] for i in group])
            differ = np.flatnonzero((rows != rows[0]).any(axis=0))
            n = min(int(differ[0]) if len(differ) else shortest, shortest - 1)
            if n - base >= min_length:
                if len(levels) == level:
                    levels.append([])
                levels[level].append((group, n))
                split(group, n, n, level + 1)
            elif n > depth:
                split(group, n, base, level)

    split(list(range(len(prompts))), 0, 0, 0)
    return levels
