"""From engine tokens to text: incremental detokenization, stop strings, and the result of each request.

`TextEngine` wraps an `Engine` for the user-facing layers (the `LLM` API, the batch runner, the server):
requests go in as token ids with sampling parameters and stop strings; text deltas and finished
`Result`s come out, each request's to the `on_event` it was submitted with (and every step's as its return value).
A stop string ends the request in the engine at once (`Engine.finish` with the string as its reason), freeing its
slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from jaxllama.engine.request import Request, SamplingParams, Timings, TopLogprobs
from jaxllama.errors import InvalidParameter
from jaxllama.results import Event, Result
from jaxllama.text.stops import StopMatcher
from jaxllama.text.structured import Grammar
from jaxllama.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxllama.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class _Choice:
    """The engine's id for choice `index` of request `id` (a request with n > 1)."""

    id: object
    index: int


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's choice `index`: its own stream, derived from the request's seed (choice 0 keeps it, so
    n = 1 answers as before); None stays None (each choice then gets a seed of its own)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


class _ChoiceText:
    """One request's text: incremental detokenizer followed by the stop-string stream."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], include_stop: bool):
        self.decoder = tokenizer.incremental_decoder(skip_special=True)
        self.stops = StopMatcher(list(stops), include_stop).stream() if stops else None
        self.text, self.tokens, self.logprobs, self.top = [], [], [], []

    def push(self, tokens: list[int], logprobs: list[float], top: list[TopLogprobs] | None = None) -> str:
        out = []
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if self.stopped:
                break
            self.tokens.append(t)
            self.logprobs.append(lp)
            self.top.append(top[i] if top is not None else [])
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
    text: _ChoiceText
    prompt_tokens: int
    want_logprobs: bool
    params: SamplingParams
    finishing: bool = False  # the engine was told to end it
    id: object = None  # the request's id (the engine's is a _Choice for n > 1)
    index: int = 0
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None
    started: bool = False  # its first event has gone out
    on_event: Callable[[Event], None] | None = None  # where its request's events go


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """One prompt to complete, as the text engine runs it: its token ids and sampling parameters; the stop strings
    that end its text (cut off, unless `include_stop`); whether each token's log-probability is reported
    (`logprobs`); its `priority` (higher gets a slot first: `Request.priority`); the `grammar` its text must match
    (its tokens are drawn only among those that keep it matching; a text cut by max_tokens ends with "length");
    and `n`, the samples of the prompt, each with its own random stream (`choice_seed`): admitted together, they
    compute the prompt once."""

    prompt: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    include_stop: bool = False
    logprobs: bool = False
    priority: int = 0
    grammar: Grammar | None = None
    n: int = 1


class TextEngine:
    """Drives an engine for requests given as token ids; not thread-safe (one thread calls `step`)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.pending: dict[object, _Pending] = {}  # by the engine's id: the request's, or a _Choice's
        self._choices: dict[object, list] = {}  # request id -> the engine ids of its choices not finished

    def submit(self, id, request: TextRequest, on_event: Callable[[Event], None] | None = None) -> None:
        """Queue a request under `id`, its events handed to `on_event` as the steps give them (in order; the last
        has `last` set); raises ValueError (naming the problem) if it can never run."""
        params, n, grammar = request.params, request.n, request.grammar
        if id in self._choices:
            raise ValueError(f"request id {id!r} is already running")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n={n!r}: must be a positive integer")
        if grammar is not None and params.min_tokens:
            raise InvalidParameter(
                "min_tokens: not with structured output, whose grammar decides where it ends", "min_tokens"
            )
        _ChoiceText(self.tokenizer, request.stop, request.include_stop)  # validates the stop strings
        choices = []
        for i in range(n):
            sampled = dataclasses.replace(params, seed=choice_seed(params.seed, i))
            constraint = grammar.matcher() if grammar is not None else None
            key = id if n == 1 else _Choice(id, i)
            choices.append(
                Request(key, list(request.prompt), sampled, priority=request.priority, constraint=constraint)
            )
        for choice in choices:
            self.engine.check(choice)
        for i, choice in enumerate(choices):
            self.engine.add(choice)
            text = _ChoiceText(self.tokenizer, request.stop, request.include_stop)
            pending = _Pending(text, len(request.prompt), request.logprobs, params, False, id, i, on_event=on_event)
            self.pending[choice.id] = pending
        self._choices[id] = [choice.id for choice in choices]

    def running(self, id) -> bool:
        """Whether request `id` has a choice that has not finished."""
        return id in self._choices

    def cancel(self, id) -> None:
        """Stop a request. A running choice ends with a "cancelled" `Result` at the next step; one still waiting
        for a slot is dropped at once, with no event."""
        for key in list(self._choices.get(id, ())):
            waiting = self.engine.is_waiting(key)
            self.engine.finish(key, "cancelled")
            if waiting:
                self.pending.pop(key, None)
                self._choice_done(id, key)

    def _choice_done(self, id, key) -> bool:
        """Choice `key` of request `id` has finished; whether it was the request's last."""
        left = self._choices.get(id, [])
        if key in left:
            left.remove(key)
        if left:
            return False
        self._choices.pop(id, None)
        return True

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[Event]:
        """One step of the engine -> its events, each also handed to its request's `on_event`."""
        events = self._events()
        for event, on_event in events:
            if on_event is not None:
                on_event(event)
        return [event for event, _ in events]

    def _events(self) -> list[tuple[Event, Callable[[Event], None] | None]]:
        """The step's events, each with its request's `on_event`."""
        events = []
        for u in self.engine.step():
            p = self.pending.get(u.id)
            if p is None:
                continue
            before = len(p.text.tokens)
            delta = p.text.push(u.tokens, u.logprobs, u.top_logprobs)  # tokens after a stop string are dropped
            new_ids = p.text.tokens[before:]
            new_logprobs = p.text.logprobs[before:] if p.want_logprobs else None
            new_top = p.text.top[before:] if p.want_logprobs and p.params.top_logprobs and new_ids else None
            if u.prompt_logprobs is not None:
                p.prompt_logprobs = u.prompt_logprobs
            prompt_logprobs = p.prompt_logprobs if not p.started else None
            if u.finish_reason is None:
                if p.text.stopped and not p.finishing:
                    self.engine.finish(u.id, "stop", p.text.stops.stop_reason)  # free the slot now
                    p.finishing = True
                if delta or new_ids or prompt_logprobs:
                    p.started = True
                    event = Event(p.id, delta, None, new_ids, new_logprobs, p.index, False, new_top, prompt_logprobs)
                    events.append((event, p.on_event))
                continue
            reason, stop_reason = u.finish_reason, u.stop_reason
            # A stop string in this last update's text ends it, whatever else did (but an error stays an error)
            if p.text.stopped and u.error is None:
                reason, stop_reason = "stop", p.text.stops.stop_reason
            delta += p.text.finish()
            del self.pending[u.id]
            result = Result(
                id=p.id,
                text="".join(p.text.text),
                token_ids=p.text.tokens,
                finish_reason=reason,
                stop_reason=stop_reason,
                prompt_tokens=p.prompt_tokens,
                timings=u.timings or Timings(),
                logprobs=p.text.logprobs if p.want_logprobs else None,
                cached_tokens=u.cached_tokens,
                top_logprobs=p.text.top if p.want_logprobs and p.params.top_logprobs else None,
                prompt_logprobs=p.prompt_logprobs,
                error=u.error,
            )
            last = self._choice_done(p.id, u.id)
            event = Event(p.id, delta, result, new_ids, new_logprobs, p.index, last, new_top, prompt_logprobs)
            events.append((event, p.on_event))
        return events

    def run(self) -> Iterator[Event]:
        while self.has_work():
            yield from self.step()
