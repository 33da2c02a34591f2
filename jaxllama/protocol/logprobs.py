"""An answer's log-probabilities in OpenAI's shapes, whole or a streamed piece at a time, for the server and the job
records alike: chat's `logprobs.content` (each token with its `top_logprobs` alternatives) and the completions'
legacy object (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`), which with `echo`
starts with the prompt's tokens, the first of them null (nothing comes before it).

Each token's text is that token decoded on its own; `text_offset` is where each token starts, counting the texts of
the tokens before it (an echoed prompt's from its start, the completion's from the end of the prompt's text), whole
or streamed alike (as vLLM counts them: where a character's bytes are cut between tokens, not the answer's text).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllama.engine.request import TopLogprobs
from jaxllama.protocol.requests import OutputOptions
from jaxllama.protocol.responses import finite_logprobs

if TYPE_CHECKING:
    from jaxllama.results import Event, Result
    from jaxllama.text.tokenizer import Tokenizer


def answer_logprobs(
    kind: str, tokenizer: Tokenizer, options: OutputOptions, prompt: list[int], result: Result, echoed: str = ""
):
    """The `logprobs` of a whole answer (None unless asked); `echoed`: the prompt's text answered before it."""
    if not options.logprobs or result.logprobs is None:
        return None
    return _logprobs(kind, tokenizer, options, prompt, result.prompt_logprobs, result, 0, echoed)


def piece_logprobs(
    kind: str,
    tokenizer: Tokenizer,
    options: OutputOptions,
    prompt: list[int],
    event: Event,
    offset: int,
    echoed: str = "",
):
    """The `logprobs` of a streamed piece (None unless asked or when it has no tokens): its tokens, and on the
    first piece the echoed prompt's (whose text, `echoed`, comes first). `offset`: where the piece's first token
    starts (0, then the last piece's last offset plus its token's length)."""
    if not options.logprobs or event.logprobs is None:
        return None
    if not event.token_ids and not (options.echo and event.prompt_logprobs is not None):
        return None
    return _logprobs(kind, tokenizer, options, prompt, event.prompt_logprobs, event, offset, echoed)


def _logprobs(kind, tokenizer, options: OutputOptions, prompt, prompt_logprobs, answer, offset: int, echoed: str):
    text = tokenizer.token_text
    tokens = [text(t) for t in answer.token_ids]
    top = answer.top_logprobs or [[] for _ in tokens]
    if kind == "chat":
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode("utf-8")),
                    "top_logprobs": [
                        {"token": text(i), "logprob": v, "bytes": list(text(i).encode("utf-8"))}
                        for i, v in zip(ids, finite_logprobs(values), strict=True)
                    ],
                }
                for t, lp, (ids, values) in zip(tokens, finite_logprobs(answer.logprobs), map(_split, top), strict=True)
            ]
        }
    token_logprobs: list[float | None] = finite_logprobs(answer.logprobs)
    tops = [_alternatives(text, alternatives) for alternatives in top]
    offsets = _offsets(tokens, offset + len(echoed))
    if options.echo and prompt_logprobs is not None:
        echoed_tokens = [text(t) for t in prompt]
        tokens = echoed_tokens + tokens
        token_logprobs = [None, *finite_logprobs([lp for lp, _ in prompt_logprobs]), *token_logprobs]
        tops = [None, *(_alternatives(text, alternatives) for _, alternatives in prompt_logprobs), *tops]
        offsets = _offsets(echoed_tokens, offset) + offsets
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops if options.top_logprobs else None,
        "text_offset": offsets,
    }


def _offsets(tokens: list[str], start: int) -> list[int]:
    out = []
    for t in tokens:
        out.append(start)
        start += len(t)
    return out


def _split(top: TopLogprobs) -> tuple[list[int], list[float]]:
    return [i for i, _ in top], [lp for _, lp in top]


def _alternatives(text, top: TopLogprobs) -> dict[str, float]:
    """{token text: log-probability}, the most likely first (of tokens that read the same, the most likely)."""
    out: dict[str, float] = {}
    for i, lp in zip(*_split(top), strict=True):
        out.setdefault(text(i), finite_logprobs([lp])[0])
    return out
