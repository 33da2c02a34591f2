"""What the scheduler keeps for a request holding a decode slot, and the updates its sampled tokens make: the tokens
of a step's `Sampled` read for one slot, with their log-probabilities, the request's usage, and on its last update
why it ended and its timings. Plain Python; the scheduler decides what a slot runs, this says what it gave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from jaxllama.engine.interface import FINISH, STOPPED, PromptLogprobs, Sampled
from jaxllama.engine.request import FinishReason, Request, Timings, TopLogprobs, Update

# Who ended a request in `Slot.take`: the device (its length, an end-of-generation or stop token), or the host (the
# request's constraint), in which case the device still runs the row until it is told to stop it.
DEVICE, HOST = "device", "host"
Ended = Literal["device", "host"] | None


@dataclasses.dataclass
class Slot:
    """A request running in a slot."""

    request: Request
    length: int  # tokens in the cache after the last step (prompt + sampled - 1 pending input)
    generated: int = 0
    prefill_start: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    prompt_logprobs: PromptLogprobs | None = None  # of the prompt's tokens after the first, when computed

    def take(self, out: Sampled, column: int, first: bool, clock: Callable[[], float]) -> tuple[Update, Ended]:
        """Take what the device sampled for this slot (column `column` of `out`) -> (the request's update, who ended
        it or None). `first`: the prefill's token, whose update also says the prompt's size; `clock` gives the
        time a last update is stamped with."""
        params = self.request.params
        steps = [i for i in range(out.emitted.shape[0]) if out.emitted[i, column]]
        if first and params.max_tokens == 0:  # the prompt alone was asked for: its sampled token is dropped
            steps = []
        tokens = [int(out.tokens[i, column]) for i in steps]
        logprobs = [float(out.logprobs[i, column]) for i in steps]
        extra = {}
        if params.top_logprobs and out.top_ids is not None:
            n = params.top_logprobs
            extra["top_logprobs"] = [_top(out.top_ids[i, column], out.top_logprobs[i, column], n) for i in steps]
        if first and params.prompt_logprobs is not None and self.prompt_logprobs is not None:
            p, n = self.prompt_logprobs, params.prompt_logprobs
            # Whole arrays to Python at once: an element at a time, a scoring job's 170k positions took seconds.
            ids, values = p.top_ids[:, :n].tolist(), p.top_logprobs[:, :n].tolist()
            extra["prompt_logprobs"] = [
                (lp, list(zip(i, v, strict=True))) for lp, i, v in zip(p.logprobs.tolist(), ids, values, strict=True)
            ]
        self.generated += len(tokens)
        self.tokens += tokens
        if first and params.max_tokens == 0:
            reason, code = "length", None
        else:
            code = int(out.finish[steps[-1], column]) if steps else None
            reason = FINISH[code] if steps else None
        constraint = self.request.constraint
        if constraint is not None:
            if reason is None:
                for t in tokens:
                    constraint.accept(t)
            # A matcher past its limits allows only an end-of-generation id: what it ended is an error, not "stop"
            error = constraint.error
            if error is not None or (reason is None and constraint.done):
                ended = HOST if reason is None else DEVICE
                if error is not None:
                    return self.final(tokens, logprobs, "error", None, clock(), error=error, **extra), ended
                return self.final(tokens, logprobs, "stop", None, clock(), **extra), ended
        if reason is None:
            return Update(self.request.id, tokens, logprobs, **extra, **(self.usage() if first else {})), None
        stop_token = tokens[-1] if code == STOPPED else None
        return self.final(tokens, logprobs, reason, stop_token, clock(), **extra), DEVICE

    def usage(self) -> dict:
        return dict(prompt_tokens=len(self.request.prompt), cached_tokens=self.cached)

    def final(self, tokens, logprobs, reason: FinishReason, stop_reason, now: float, **extra) -> Update:
        """The request's last update at `now`: its last tokens, why it ended, its usage and timings (`extra`: more
        `Update` fields)."""
        r = self.request
        decode_s = now - self.first_token if self.first_token else 0.0
        timings = Timings(
            queue_ms=1e3 * max(0.0, self.prefill_start - r.submitted),
            prefill_ms=1e3 * (self.first_token - self.prefill_start),
            ttft_ms=1e3 * (self.first_token - r.submitted),
            decode_ms=1e3 * decode_s,
            decode_tokens_per_s=(self.generated - 1) / decode_s if decode_s > 0 and self.generated > 1 else 0.0,
            total_ms=1e3 * (now - r.submitted),
        )
        return Update(
            r.id, tokens, logprobs, reason, stop_reason, completion_tokens=self.generated, timings=timings,
            **self.usage(), **extra,
        )  # fmt: skip


@dataclasses.dataclass
class Partial:
    """A prompt computed in chunks (`EngineOptions.step_tokens`), holding its slot between them."""

    request: Request
    done: int  # its first `done` tokens are in the slot's cache
    prefill_start: float
    cached: int  # tokens its first chunk reused from another request's


def _top(ids, logprobs, n: int) -> TopLogprobs:
    """The first n (token id, log-probability) pairs of a position's most likely tokens."""
    return [(int(i), float(lp)) for i, lp in zip(ids[:n], logprobs[:n], strict=True)]
