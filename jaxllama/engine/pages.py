"""Which pages of a paged KV cache's pool (`core/paged_kv.py`) each decode slot's sequence sits in, and which full
pages hold which tokens: plain Python, the same choices on every process.

A slot holds a list of pages, in order (position p in page p // page_size of its list). A page may be held by
several slots: a prompt that starts with tokens the pool already holds takes those full pages (`assign`) instead of
computing them again, and a page goes back to the free queue when no slot holds it. A slot writes only pages it
alone holds: a shared prefix is always a whole number of pages (the scheduler reuses prefixes in multiples of
`page_size`), and a sequence writes only past its prefix.

A full page whose tokens are known (`register`) is cached under a key of its tokens and every token before them, as
vLLM's automatic prefix caching keys its blocks: a later prompt that starts with the same tokens finds it (`cached`)
while any slot holds it, and after that too, until its place in the pool is given to another page. The free queue
gives out first the pages that hold nothing cached, then the least recently freed, a sequence's last pages before
its first (a page is of no use without the pages before it).

The pool has a slot's worth of pages at the longest context for every slot, so it never runs out: a slot holds at
most that many, shared pages are counted once, and a cached page no slot holds is free.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxllama.engine import buckets
from jaxllama.engine.interface import CACHED, PrefillRow


class PageTable:
    def __init__(self, slots: int, max_context: int, page_size: int):
        self.page_size = page_size
        self.pages_per_slot = self.pages_for(max_context)
        self.pages = slots * self.pages_per_slot  # the pool's size; also a table's entry for "no page"
        self._free = collections.OrderedDict.fromkeys(range(self.pages))  # the next to give out first
        self._holders = np.zeros(self.pages, np.int32)
        self._page_of: dict[bytes, int] = {}  # a cached page's key -> the page
        self._key_of: dict[int, bytes] = {}
        self.held: list[list[int]] = [[] for _ in range(slots)]

    def assign(self, rows: Sequence[tuple[int, int | Sequence[int], int, int]]) -> None:
        """For each (slot, source, start, length): the slot's sequence becomes the first `start` positions (a
        multiple of the page size: whole pages, shared) of `source`'s sequence, where `source` is a slot, or of the
        pages `source` lists (`cached`), then pages of its own up to `length` positions. Every row's prefix is the one
        its source held before the call (a source may be refilled by another row, or be the row's own slot)."""
        shared = []
        for _, source, start, _ in rows:
            if start % self.page_size:
                raise ValueError(f"a prefix of {start} positions is not a whole number of {self.page_size}-pages")
            if isinstance(source, int) and not 0 <= source < len(self.held):
                raise ValueError(f"no slot {source} (a cached prefix's source is its pages: `assign_rows`)")
            pages = list(self.held[source] if isinstance(source, int) else source)[: start // self.page_size]
            if len(pages) * self.page_size < start:
                raise ValueError(f"the prefix's source has {len(pages)} pages, not {start} positions")
            for page in pages:  # held before any slot lets its own go: the same pages may be both
                self._hold(page)
            shared.append(pages)
        # Every slot lets its old pages go before any takes new ones: a row's prefix taken from the free queue
        # (`cached`) counts against the pool while the slot it refills still holds its old pages.
        for (slot, *_), pages in zip(rows, shared, strict=True):
            self.release(slot)
            self.held[slot] = pages
        for slot, _, _, length in rows:
            self.reserve(slot, length)

    def assign_rows(self, rows: Sequence[PrefillRow]) -> None:
        """`assign` a prefill's rows, each over its source's prefix (`PrefillRow.source`; `CACHED`: the pool's)."""
        source = lambda r: self.cached(r.request.prompt, r.start) if r.source == CACHED else r.source
        self.assign([(r.slot, source(r), r.start, r.start + len(r.tokens)) for r in rows])

    def reserve(self, slot: int, length: int) -> None:
        """Give the slot pages for its positions [0, length) (at most a slot's worth)."""
        need = min(self.pages_for(length), self.pages_per_slot) - len(self.held[slot])
        for _ in range(need):
            page, _ = self._free.popitem(last=False)  # never empty: see the module's docstring
            key = self._key_of.pop(page, None)
            if key is not None:  # what it cached is gone
                del self._page_of[key]
            self._holders[page] = 1
            self.held[slot].append(page)

    def release(self, slot: int) -> None:
        """The slot holds no pages; those no other slot holds are free again, those that cache tokens given out
        after those that do not, and its last pages before its first."""
        for page in reversed(self.held[slot]):
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free[page] = None
                if page not in self._key_of:
                    self._free.move_to_end(page, last=False)
        self.held[slot] = []

    def register(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's pages hold the keys and values of `tokens` (its sequence from position 0): cache each full page
        under its key, for later prompts that start with the same tokens (a page whose tokens another page caches
        already is left out)."""
        key = b""
        for i, page in enumerate(self.held[slot][: len(tokens) // self.page_size]):
            if page in self._key_of:
                key = self._key_of[page]
                continue
            key = self._key(key, tokens[i * self.page_size : (i + 1) * self.page_size])
            if key not in self._page_of:
                self._page_of[key], self._key_of[page] = page, key

    def cached(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The pages that cache `tokens`' first full pages, as far as the pool has them in order, at most `limit`
        positions' worth."""
        pages, key = [], b""
        for i in range(min(len(tokens), limit) // self.page_size):
            key = self._key(key, tokens[i * self.page_size : (i + 1) * self.page_size])
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def _key(self, before: bytes, tokens: Sequence[int]) -> bytes:
        """A page's key: a digest of its tokens and, through `before` (the key of the page before it), of every
        token before them (128 bits: two different prefixes never share one in practice)."""
        return hashlib.blake2b(before + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()

    def _hold(self, page: int) -> None:
        if self._holders[page] == 0:
            del self._free[page]
        self._holders[page] += 1

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
        """The page tables of a prefill's `n` rows (the scheduler gave them their pages: `assign_rows`), as many
        pages as its `span` of positions: each row's slot's, a chunk's too (it lands in no decode slot, but its keys
        in its slot's pages); a padding row's none."""
        return self.table([r.slot for r in rows] + [len(self.held)] * (n - len(rows)), self.pages_for(span))

    def decode_table(self, columns: Sequence[int], max_context: int) -> np.ndarray:
        """The page tables of a decode step's columns (an index past the last slot: padding): as many pages as the
        longest sequence's bucket of positions."""
        longest = max((self.positions(c) for c in columns if c < len(self.held)), default=1)
        return self.table(columns, self.pages_for(buckets.bucket(longest, max_context)))

    @property
    def free(self) -> int:
        """Pages no slot holds (some caching tokens still)."""
        return len(self._free)
