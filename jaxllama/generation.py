"""From engine tokens to text: incremental detokenization, stop strings, and the result of each request.

`Generation` wraps an `Engine` for the user-facing layers (the `LLM` API, the batch runner, the server):
requests go in as token ids with sampling parameters and stop strings; text deltas and finished
`Result`s come out. A stop string ends the request in the engine at once (`Engine.finish` with the string as its
reason), freeing its slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from jaxllama.engine.request import Request, SamplingParams, Timings
from jaxllama.engine.scheduler import Scheduler
from jaxllama.text.stops import StopMatcher
from jaxllama.text.tokenizer import Tokenizer


@dataclasses.dataclass
class Result:
    """A finished request."""

    id: object
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-generation token or stop string) | "length"
    stop_reason: str | int | None  # the stop string or token id that ended it
    prompt_tokens: int
    timings: Timings
    logprobs: list[float] | None = None
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused from an earlier request

    @property
    def usage(self) -> dict:
        """OpenAI's usage object."""
        n = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclasses.dataclass
class Event:
    """New text of one request (`delta`), the tokens that made it (with their log-probabilities when the request
    asked for them), and its `Result` when it has finished."""

    id: object
    delta: str
    result: Result | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None


class _Text:
    """One request's text: incremental detokenizer followed by the stop-string stream."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], include_stop: bool):
        self.decoder = tokenizer.incremental_decoder(skip_special=True)
        self.stops = StopMatcher(list(stops), include_stop).stream() if stops else None
        self.text, self.tokens, self.logprobs = [], [], []

    def push(self, tokens: list[int], logprobs: list[float]) -> str:
        out = []
        for t, lp in zip(tokens, logprobs, strict=True):
            if self.stopped:
                break
            self.tokens.append(t)
            self.logprobs.append(lp)
            piece = self.decoder.push(t)
            out.append(self.stops.push(piece) if self.stops else piece)
        delta = "".join(out)
        self.text.append(delta)
        return delta

    def finish(self) -> str:
        tail = self.decoder.flush()
        if self.stops:
            tail = self.stops.push(tail) + (self.stops.finish() if not self.stops.stopped else "")
        self.text.append(tail)
        return tail

    @property
    def stopped(self) -> bool:
        return bool(self.stops and self.stops.stopped)


@dataclasses.dataclass
class _Pending:
    text: _Text
    prompt_tokens: int
    want_logprobs: bool
    finishing: bool = False  # the engine was told to end it


class Generation:
    """Drives an engine for requests given as token ids; not thread-safe (one thread calls `step`)."""

    def __init__(self, engine: Scheduler, tokenizer: Tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.pending: dict[object, _Pending] = {}

    def submit(
        self,
        id,
        prompt: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        logprobs: bool = False,
        priority: int = 0,
    ) -> None:
        """Queue a request; raises ValueError (naming the problem) if it can never run. Requests of higher
        `priority` get a slot first (`Request.priority`)."""
        if id in self.pending:
            raise ValueError(f"request id {id!r} is already running")
        text = _Text(self.tokenizer, stop, include_stop)  # validates the stop strings
        self.engine.add(Request(id, list(prompt), params, priority=priority))
        self.pending[id] = _Pending(text, len(prompt), logprobs)

    def cancel(self, id) -> None:
        """Stop a request. A running one ends with a "cancelled" `Result` at the next step; one still waiting
        for a slot is dropped at once, with no event."""
        waiting = self.engine.is_waiting(id)
        self.engine.finish(id, "cancelled")
        if waiting:
            self.pending.pop(id, None)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[Event]:
        events = []
        for u in self.engine.step():
            p = self.pending.get(u.id)
            if p is None:
                continue
            before = len(p.text.tokens)
            delta = p.text.push(u.tokens, u.logprobs)  # tokens after a stop string are dropped
            new_ids = p.text.tokens[before:]
            new_logprobs = p.text.logprobs[before:] if p.want_logprobs else None
            if u.finish_reason is None:
                if p.text.stopped and not p.finishing:
                    self.engine.finish(u.id, "stop", p.text.stops.stop_reason)  # free the slot now
                    p.finishing = True
                if delta or new_ids:
                    events.append(Event(u.id, delta, None, new_ids, new_logprobs))
                continue
            reason, stop_reason = u.finish_reason, u.stop_reason
            if p.text.stopped:  # a stop string in this last update's text ends it, whatever else did
                reason, stop_reason = "stop", p.text.stops.stop_reason
            delta += p.text.finish()
            del self.pending[u.id]
            result = Result(
                id=u.id,
                text="".join(p.text.text),
                token_ids=p.text.tokens,
                finish_reason=reason,
                stop_reason=stop_reason,
                prompt_tokens=p.prompt_tokens,
                timings=u.timings or Timings(),
                logprobs=p.text.logprobs if p.want_logprobs else None,
                cached_tokens=u.cached_tokens,
            )
            events.append(Event(u.id, delta, result, new_ids, new_logprobs))
        return events

    def run(self) -> Iterator[Event]:
        while self.has_work():
            yield from self.step()
