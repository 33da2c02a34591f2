"""What a job asks of the engine, line by line, read as `jaxllama run` reads it: each line's prompts as token ids and
how many tokens each of its samples may generate; a line `run` would refuse is kept with its error, not dropped.
`jaxllama compile --job` predicts the job's time from these (`engine/job_clock.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxllama.batch.jobs import read_job
from jaxllama.engine.request import SamplingParams
from jaxllama.errors import InvalidRequest
from jaxllama.protocol.pipeline import Encoder, RequestPipeline


@dataclasses.dataclass
class JobSizes:
    """A job's requests (one per sample of each line's prompt): prompt token ids and output tokens; the lines
    refused, by line number, with why."""

    requests: list[tuple[list[int], int]]
    refused: dict[int, str]
    lines: int


class TokenIdsOnly:
    """The encoder of a model known by its shape alone (no tokenizer): prompts must be token ids."""

    def encode(self, text: str) -> list[int]:
        raise InvalidRequest("prompt: a text prompt needs the model's tokenizer (give --model a checkpoint)", "prompt")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        raise InvalidRequest("messages: a conversation needs the model's tokenizer (give --model a checkpoint)")

    def grammar(self, output, stop_token_ids):
        return None

    def decode(self, ids: list[int]) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class SizesOnly:
    """A model's encoder for sizing a job: its prompts encoded as `run` encodes them; a structured line's grammar
    not compiled (it does not change how many tokens are computed)."""

    encoder: Encoder

    def encode(self, text: str) -> list[int]:
        return self.encoder.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encoder.encode_chat(messages)

    def grammar(self, output, stop_token_ids):
        return None

    def decode(self, ids: list[int]) -> str:
        return self.encoder.decode(ids)


def job_sizes(
    job: Path,
    encoder: Encoder,
    defaults: SamplingParams | None = None,
    system_prompt: str | None = None,
    assume_output: int | None = None,
) -> JobSizes:
    """The job's requests and refused lines. A sample's output length is its line's max_tokens (every answer as long
    as it may be: a stop string or end-of-generation token cannot be foreseen), or with `assume_output` at most
    that many. `defaults`: what a line leaves unsaid (`jaxllama run`'s flags)."""
    pipeline = RequestPipeline(encoder, defaults or SamplingParams(), (), system_prompt, output_options=False)
    requests, refused = [], {}
    lines = read_job(Path(job))
    for line in lines:
        try:
            kind, body = line.request()
            prepared = pipeline.prepare(body, kind)
        except Exception as e:  # what `run` writes as the line's error record
            refused[line.number] = str(e)
            continue
        output = prepared.params.max_tokens
        if assume_output is not None:
            output = min(output, assume_output)
        requests += [(prompt, output) for prompt in prepared.prompts for _ in range(prepared.n)]
    return JobSizes(requests, refused, len(lines))
