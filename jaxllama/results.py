"""What a request's generation gives back: `Result`, a finished request (one sample), and `Event`, a piece of one as
it streams; `usage`, OpenAI's token counts of an answer. Plain values, below every layer that makes them
(`text_engine.py`) or formats them (`protocol/`, the batch runner's records, the server).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxllama.engine.request import Timings, TopLogprobs


@dataclasses.dataclass
class Result:
    """A finished request."""

    id: object
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-generation token or stop string) | "length" | "cancelled" | "error"
    stop_reason: str | int | None  # the stop string or token id that ended it
    prompt_tokens: int
    timings: Timings
    logprobs: list[float] | None = None
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused from an earlier request
    top_logprobs: list[TopLogprobs] | None = None  # per token, with logprobs and params.top_logprobs > 0
    # With params.prompt_logprobs: per prompt token after the first, (its log-probability, its alternatives).
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None
    # With finish_reason "error": why the output could not be completed (its grammar reached the matcher's limits);
    # its text is not an answer.
    error: Exception | None = None

    @property
    def usage(self) -> dict:
        """OpenAI's usage object of this result alone (`usage`)."""
        return usage([[self]])


def usage(prompts: Sequence[Sequence[Result]]) -> dict:
    """OpenAI's usage object of an answer, from each prompt's results (its n samples): every prompt counted once, with
    the tokens its first sample found in the cache, and every sample's generated tokens."""
    firsts = [samples[0] for samples in prompts]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for samples in prompts for r in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }


@dataclasses.dataclass
class Event:
    """New text of one request's choice `index` (`delta`; a request asked for n samples has choices 0..n-1), the
    tokens that made it (with their log-probabilities when the request asked for them), and the choice's `Result`
    when it has finished; `last`: every choice of the request has finished (this is its last event)."""

    id: object
    delta: str
    result: Result | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    index: int = 0
    last: bool = False
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None  # on a request's first event, as `Result`'s
