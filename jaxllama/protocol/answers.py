"""A prepared request's whole answer, for the server and the job records alike: a choice per prompt and sample
(prompt i's sample j is choice i * n + j, as OpenAI numbers them), its text after the prompt's when the request asked
for `echo`, with the log-probabilities it asked for (`logprobs.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllama.protocol import responses
from jaxllama.protocol.logprobs import answer_logprobs
from jaxllama.protocol.pipeline import PreparedRequest
from jaxllama.results import usage as usage_of

if TYPE_CHECKING:
    from jaxllama.results import Result
    from jaxllama.text.tokenizer import Tokenizer


def answer(request: PreparedRequest, results: list[list[Result]], model: str, tokenizer: Tokenizer) -> dict:
    """The `chat.completion` or `text_completion` of `request`, whose prompts gave `results` (per prompt, in order,
    its n samples)."""
    flat, texts, logprobs = [], [], []
    for i, (prompt, samples) in enumerate(zip(request.prompts, results, strict=True)):
        echoed = request.texts[i] if request.options.echo else ""
        for result in samples:
            flat.append(result)
            texts.append(echoed + result.text)
            logprobs.append(answer_logprobs(request.kind, tokenizer, request.options, prompt, result, echoed))
    total = usage_of(results)
    return responses.completion(request.kind, flat, request.model or model, logprobs=logprobs, texts=texts, usage=total)
