"""Which pages of a paged KV cache's pool (`core/paged_kv.py`) each decode slot's sequence sits in: plain Python, the
same choices on every process.

A slot holds a list of pages, in order (position p in page p // page_size of its list). A page may be held by
several slots: a prompt that starts with another slot's sequence takes that slot's full pages for the prefix
(`assign`) instead of copying them, and a page goes back to the free list when no slot holds it. A slot writes only
pages it alone holds: a shared prefix is always a whole number of pages (the scheduler reuses prefixes in multiples
of `page_size`), and a sequence writes only past its prefix.

The pool has a slot's worth of pages at the longest context for every slot, so it never runs out: a slot holds at
most that many, and shared pages are counted once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxllama.engine import buckets
from jaxllama.engine.interface import PrefillRow


class PageTable:
    def __init__(self, slots: int, max_context: int, page_size: int):
        self.page_size = page_size
        self.pages_per_slot = self.pages_for(max_context)
        self.pages = slots * self.pages_per_slot  # the pool's size; also a table's entry for "no page"
        self._free = list(range(self.pages - 1, -1, -1))  # a stack: the lowest pages are given out first
        self._holders = np.zeros(self.pages, np.int32)
        self.held: list[list[int]] = [[] for _ in range(slots)]

    def assign(self, rows: Sequence[tuple[int, int, int, int]]) -> None:
        """For each (slot, source, start, length): the slot's sequence becomes the first `start` positions of
        `source`'s (a multiple of the page size: whole pages, shared), then pages of its own up to `length`
        positions. Every row's prefix is the one its source held before the call (a source may be refilled by
        another row, or be the row's own slot)."""
        shared = []
        for _, source, start, _ in rows:
            if start % self.page_size:
                raise ValueError(f"a prefix of {start} positions is not a whole number of {self.page_size}-pages")
            pages = self.held[source][: start // self.page_size]
            if len(pages) * self.page_size < start:
                raise ValueError(f"slot {source} holds {len(self.held[source])} pages, not {start} positions")
            for page in pages:  # held before any slot lets its own go: the same pages may be both
                self._holders[page] += 1
            shared.append(pages)
        for (slot, _, _, length), pages in zip(rows, shared, strict=True):
            self.release(slot)
            self.held[slot] = list(pages)
            self.reserve(slot, length)

    def reserve(self, slot: int, length: int) -> None:
        """Give the slot pages for its positions [0, length) (at most a slot's worth)."""
        need = min(self.pages_for(length), self.pages_per_slot) - len(self.held[slot])
        for _ in range(need):
            page = self._free.pop()  # never empty: see the module's docstring
            self._holders[page] = 1
            self.held[slot].append(page)

    def release(self, slot: int) -> None:
        """The slot holds no pages; those no other slot holds are free again."""
        for page in reversed(self.held[slot]):
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)
        self.held[slot] = []

    def pages_for(self, positions: int) -> int:
        """The pages that hold `positions` positions."""
        return -(-positions // self.page_size)

    def positions(self, slot: int) -> int:
        """The positions the slot's pages hold."""
        return len(self.held[slot]) * self.page_size

    def table(self, slots: Sequence[int], width: int) -> np.ndarray:
        """The page tables [len(slots), width] int32 of `slots` (an index past the last slot: a row of no pages),
        each padded with `pages` (no page: writes dropped, reads masked)."""
        out = np.full((len(slots), width), self.pages, np.int32)
        for row, slot in enumerate(slots):
            held = self.held[slot][:width] if slot < len(self.held) else []
            out[row, : len(held)] = held
        return out

    def prefill_table(self, rows: Sequence[PrefillRow], n: int, span: int) -> np.ndarray:
        """Give a prefill's rows their pages (a reused prefix's shared) -> the page tables of its `n` rows, as many
        pages as its `span` of positions: each row's slot's, a chunk's too (it lands in no decode slot, but its keys
        in its slot's pages); a padding row's none."""
        self.assign([(r.slot, r.source, r.start, r.start + len(r.tokens)) for r in rows])
        return self.table([r.slot for r in rows] + [len(self.held)] * (n - len(rows)), self.pages_for(span))

    def decode_table(self, columns: Sequence[int], max_context: int) -> np.ndarray:
        """The page tables of a decode step's columns (an index past the last slot: padding): as many pages as the
        longest sequence's bucket of positions."""
        longest = max((self.positions(c) for c in columns if c < len(self.held)), default=1)
        return self.table(columns, self.pages_for(buckets.bucket(longest, max_context)))

    @property
    def free(self) -> int:
        return len(self._free)
