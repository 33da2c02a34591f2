"""What the engine is asked to do and what it answers, as plain Python: a request (prompt token ids and how to
sample them), the updates it produces, and why a request finished. The scheduler, the request pipeline and the
user-facing layers share these types; none of them needs jax.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Literal, Protocol

import numpy as np

from jaxllama.errors import ContextLengthExceeded, InvalidParameter, InvalidRequest, is_int

# Why a request ended: an end-of-generation token or a stop string ("stop"), its token budget or the context
# ("length"), a `finish` call from outside ("cancelled", or "stop" for a stop string found in the text), or its
# output constraint failing ("error", with `Update.error`).
FinishReason = Literal["stop", "length", "cancelled", "error"]

MAX_LOGIT_BIAS = 300  # logit_bias entries a request may give (OpenAI's limit)
# Alternatives a request may ask for at each position (OpenAI's top_logprobs limit): the device always computes
# this many, so that one compiled program serves every request that asks.
MAX_LOGPROBS = 20

# A token's log-probability and its alternatives at that position: (token id, log-probability) pairs, the most
# likely first.
TopLogprobs = list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF/CTRL style, on prompt and generated tokens
    presence_penalty: float = 0.0  # OpenAI style, on generated tokens
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # extra end-of-generation ids for this request
    min_tokens: int = 0  # before this many tokens, no end-of-generation or stop token id is sampled (vLLM's)
    ignore_eos: bool = False  # the model's end-of-generation ids do not end it (stop_token_ids still do)
    # OpenAI's {token_id: bias}: added to those tokens' logits before sampling; held as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities reported beside the sampled tokens' own: the `top_logprobs` most likely tokens at each
    # generated position, and with `prompt_logprobs` (None: none) each prompt token's, given the tokens before it,
    # with that many alternatives (vLLM's). max_tokens 0 ends a request after its prompt (for prompt_logprobs).
    top_logprobs: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParameter naming the field when a parameter is out of range."""
        checks = [
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 0, "must be an integer >= 0"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be an integer >= 0"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "must be an integer >= 0"),
            (
                "min_tokens",
                is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens if is_int(self.max_tokens) else 0),
                "must be an integer from 0 to max_tokens",
            ),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be true or false"),
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(t >= 0 and _finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
                f"at most {MAX_LOGIT_BIAS} token ids >= 0, each with a bias in [-100, 100]",
            ),
            (
                "top_logprobs",
                is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_LOGPROBS,
                f"must be an integer from 0 to {MAX_LOGPROBS}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"must be an integer from 0 to {MAX_LOGPROBS}",
            ),
            ("repetition_penalty", _finite(self.repetition_penalty) and self.repetition_penalty > 0, "must be > 0"),
            (
                "presence_penalty",
                _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "must be in [-2, 2]",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParameter(f"{name}={getattr(self, name)!r}: {why}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping (JSON gives its keys as strings) or pairs."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = {}
        for token, bias in items:
            if isinstance(token, bool) or isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError
            # a key is a token id written in ASCII digits: int() would also take "٣", "1_0" and " 5 "
            if isinstance(token, str) and not (token.isascii() and token.isdigit()):
                raise ValueError
            pairs[int(token)] = float(bias)
    except (TypeError, ValueError):
        raise InvalidParameter(
            f'logit_bias={value!r}: must map token ids to numbers, e.g. {{"50256": -100}}', "logit_bias"
        ) from None
    return tuple(sorted(pairs.items()))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class TokenConstraint(Protocol):
    """What a request's output must match (structured output), as the engine sees it: a plain-Python matcher on the
    host, asked for the tokens allowed next before each token is drawn, and told each token drawn. It allows an
    end-of-generation id only where the output may end; `done` once nothing can follow (the request then ends)."""

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the tokens allowed next into out [ceil(vocab / 32)] int32, a bitmask: bit t % 32 of word t // 32
        for token t (llguidance's layout)."""

    def accept(self, token: int) -> None:
        """The token drawn."""

    @property
    def done(self) -> bool:
        """Nothing may follow the tokens accepted so far."""

    @property
    def error(self) -> Exception | None:
        """Why the output cannot go on matching (the matcher reached its limits), or None; the request then ends
        with finish_reason "error" and this error, whatever was sampled."""


def token_masks(constraints: list[TokenConstraint | None], vocab_size: int):
    """The function that gives each row's token bitmask [rows, ceil(vocab / 32)] (its constraint's; every token where
    it has none), or None when no row is constrained: called just before the device needs them."""
    if not any(c is not None for c in constraints):
        return None
    words = (vocab_size + 31) // 32

    def fill() -> np.ndarray:
        out = np.full((len(constraints), words), -1, np.int32)
        for row, c in zip(out, constraints, strict=True):
            if c is not None:
                c.fill_mask(row)
        return out

    return fill


@dataclasses.dataclass
class Request:
    """One generation request: prompt token ids, how to sample, and optionally what the output must match."""

    id: object
    prompt: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    priority: int = 0  # admitted before queued requests of lower priority; in order of arrival among equals
    constraint: TokenConstraint | None = None


@dataclasses.dataclass
class Timings:
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_ms: float = 0.0


@dataclasses.dataclass
class Update:
    """New tokens of one request from one engine step; `finish_reason` set on its last update, with `stop_reason`:
    the end-of-generation token id or the stop string that ended it."""

    id: object
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused, not computed
    timings: Timings | None = None
    top_logprobs: list[TopLogprobs] | None = None  # per token, with params.top_logprobs > 0
    # On a request's first update, with params.prompt_logprobs set: per prompt token after the first, its
    # log-probability given the tokens before it and its params.prompt_logprobs alternatives.
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None
    error: Exception | None = None  # with finish_reason "error": why (`TokenConstraint.error`)


def check_request(request: Request, runner) -> None:
    """Raise a RequestError if the request can never run on `runner` (its `vocab_size`, `max_context`, `eos_ids` and
    `max_stop_ids`): the caller reports it for that request alone; its `SamplingParams` checked themselves when
    made."""
    n, vocab, eos = len(request.prompt), runner.vocab_size, len(tuple(runner.eos_ids))
    if n == 0:
        raise InvalidRequest("prompt is empty", "prompt")
    if n >= runner.max_context:
        raise ContextLengthExceeded(
            f"prompt is {n} tokens, the context limit is {runner.max_context} "
            "(prompt plus at least one generated token)"
        )
    bad = [t for t in request.prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    stop_ids = request.params.stop_token_ids
    if eos * (not request.params.ignore_eos) + len(stop_ids) > runner.max_stop_ids:
        extra = runner.max_stop_ids - eos
        raise InvalidParameter(f"stop_token_ids: at most {extra} extra stop token ids", "stop_token_ids")
    bad = [t for t in stop_ids if not 0 <= t < vocab]
    if bad:
        message = f"stop_token_ids={list(stop_ids)}: {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        raise InvalidParameter(message, "stop_token_ids")
    bad = [t for t, _ in request.params.logit_bias if not 0 <= t < vocab]
    if bad:
        message = f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        raise InvalidParameter(message, "logit_bias")
