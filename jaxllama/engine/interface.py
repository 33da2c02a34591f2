"""The contract between the scheduler (plain Python, `scheduler.py`) and the model runner of the engine
(`model_runner.py`): what a prefill is asked to compute, what a call samples, and why a row stopped. Plain Python, so
that the scheduler can be run and tested against any object that keeps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxllama.engine.request import Request, SamplingParams

if TYPE_CHECKING:
    from jaxllama.engine.pages import PageTable

# Why a row stopped, as the device reports it: an index into FINISH. RUNNING: it goes on (or emitted nothing).
FINISH = (None, "stop", "length")
RUNNING, STOPPED, LENGTH = range(len(FINISH))


# A `PrefillRow.source` that is no slot: the prefix's pages are those a paged cache's pool keeps for its tokens.
CACHED = -1


@dataclasses.dataclass
class PrefillRow:
    """One prompt to compute: `tokens` (the prompt past a reused prefix) at positions from `start`, over the first
    `start` positions of slot `source`'s cache (`CACHED`: of the pages a paged pool caches for the prompt's first
    tokens, `pages.PageTable.cached`), into decode slot `slot` (source == slot: computed from its start).
    Not `final`: the tokens are a chunk of the prompt, whose rest a later call computes (where the runner
    `joins_decode`); the slot does not start decoding."""

    request: Request
    tokens: list[int]
    start: int
    source: int
    slot: int
    final: bool = True


@dataclasses.dataclass
class PromptLogprobs:
    """Log-probabilities of a run of consecutive prompt tokens, each given every token before it: [t] of the tokens
    themselves, and the ids [t, k] and log-probabilities [t, k] of the k most likely tokens at each, the most likely
    first. Which tokens they are is the holder's to say."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def __len__(self) -> int:
        return len(self.logprobs)

    def __getitem__(self, part: slice) -> PromptLogprobs:
        return PromptLogprobs(self.logprobs[part], self.top_ids[part], self.top_logprobs[part])

    @staticmethod
    def join(parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
        return PromptLogprobs(*(np.concatenate(x) for x in zip(*(dataclasses.astuple(p) for p in parts), strict=True)))


@dataclasses.dataclass
class Sampled:
    """What a prefill or decode call sampled, [steps, rows] (a prefill: one step, a row per PrefillRow; a decode
    call: a row per column): the tokens, their log-probabilities, whether the row emitted a token at that step, and
    its FINISH code there (the token of a STOPPED row is the end-of-generation id that stopped it). When some row
    asked: the MAX_LOGPROBS most likely tokens at each step [steps, rows, k] (ids, log-probabilities), and, for a
    prefill, per row the log-probabilities of its tokens after the first (`PrefillRow.tokens[1:]`), given the
    tokens before them."""

    tokens: np.ndarray
    logprobs: np.ndarray
    emitted: np.ndarray
    finish: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt: list[PromptLogprobs] | None = None


class ModelRunnerInterface(Protocol):
    """What the scheduler needs of the device: its sizes, and four calls."""

    slots: int  # decode slots
    max_context: int  # positions a sequence may hold, prompt included
    decode_steps: int  # tokens each `generate` call advances a slot by
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_stop_ids: int  # end-of-generation ids a slot holds, the model's and a request's own
    row_multiple: int  # a call's row count is a multiple of this (the mesh's data axis)
    reuse_multiple: int  # a prompt reuses another slot's prefix in multiples of this many positions
    packs_prompts: bool  # a prefill's prompts of any lengths run as one batch of their tokens, none padded
    joins_decode: bool  # `prefill_and_decode` runs a prefill and a decode step as one call
    chunk_multiple: int  # a prompt computed in chunks ends each chunk but its last at a multiple of this position
    # A paged cache's page table, whose pages the scheduler assigns to a prefill's rows before the call
    # (`PageTable.assign_rows`) and whose full pages it caches by their tokens; None: a contiguous cache.
    pages: PageTable | None

    def make_room(self, needed: int, lengths: dict[int, int]) -> int:
        """Make the KV cache hold a prefill's rows' `needed` positions (a paged cache's rows have their pages from
        the scheduler: `pages`) and each slot's first `lengths[slot]`; return the positions every slot still holds
        (what a slot held past them is gone)."""

    def prefill(
        self, rows: Sequence[PrefillRow], sample: bool = True, masks: Callable[[], np.ndarray] | None = None
    ) -> Sampled | None:
        """Compute the rows into their slots; with `sample`, start them decoding and sample their first tokens
        (each among the tokens its row of `masks()` allows: [rows, ceil(vocab / 32)] int32 bitmasks). Where a row's
        request has `prompt_logprobs`, the answer has `prompt` (with no steps, without `sample`)."""

    def prefill_and_decode(
        self,
        rows: Sequence[PrefillRow],
        columns: Sequence[int],
        params: Sequence[SamplingParams],
        cancelled: Sequence[int] = (),
        masks: Callable[[], np.ndarray] | None = None,
        decode_masks: Callable[[], np.ndarray] | None = None,
    ) -> tuple[Sampled, Sampled]:
        """`prefill(rows, masks=masks)` and `generate(columns, params, cancelled, decode_masks)` of one token in one
        call (with `joins_decode`), the columns slots that run already, none of the rows'. -> (the prefill's
        `Sampled`, the decode step's)."""

    def generate(
        self,
        columns: Sequence[int],
        params: Sequence[SamplingParams],
        cancelled: Sequence[int] = (),
        masks: Callable[[], np.ndarray] | None = None,
    ) -> Sampled:
        """Advance slots `columns` (padded with the index `slots`) by `decode_steps` tokens, after stopping the slots
        `cancelled`; `params`: the sampling parameters of every running request (the programs compile only what
        they need). With `masks`, by one token only, each column's among those its row of `masks()` allows
        ([columns, ceil(vocab / 32)] int32 bitmasks, computed while the device runs the step's layers)."""
