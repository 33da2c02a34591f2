"""Structured output's cost per decode step, free of the drift between two long jobs: the same 64 chat prompts run
alternately unconstrained and under a regular expression that keeps every row going ([a-z ]{200}: no row may end
before max_tokens), each with `ignore_eos` and the same max_tokens and seeds, so that both runs generate the same
tokens per row and differ only in the masks.

    python -m benchmarks.structured_step [--rows 64] [--max-tokens 30] [--rounds 2] [--model CKPT]

Prints, per run, the engine's decode tokens/s (its decode time, compilation excluded) and wall time less
compilation; the first round compiles both and is a warm-up.
"""

from __future__ import annotations

import time

import fire

from jaxllama import LLM
from jaxllama.engine.request import SamplingParams
from jaxllama.text.structured import OutputFormat
from jaxllama.text_engine import TextRequest


def main(rows: int = 64, max_tokens: int = 30, rounds: int = 2, model: str | None = None):
    llm = LLM.load(model, max_slots=rows)
    grammar = llm.grammar(OutputFormat("regex", "[a-z ]{200}"), SamplingParams())
    prompts = [llm.encode_chat([{"role": "user", "content": f"Write about topic {i}."}]) for i in range(rows)]

    def run(name: str, constrained: bool) -> None:
        stats = llm.stats
        decode_s, tokens, compile_s, start = (
            stats.decode_s,
            stats.generated_tokens,
            stats.compile_s,
            time.perf_counter(),
        )
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True)
            request = TextRequest(prompt, params, grammar=grammar if constrained else None)
            llm.text_engine.submit(f"{name}-{i}", request)
        for _ in llm.text_engine.run():
            pass
        rate = (stats.generated_tokens - tokens) / (stats.decode_s - decode_s)
        wall = time.perf_counter() - start - (stats.compile_s - compile_s)
        kind = "constrained" if constrained else "free"
        print(
            f"{name} {kind}: {stats.generated_tokens - tokens} decode tokens, {rate:.1f} tok/s, {wall:.1f} s",
            flush=True,
        )

    for r in range(rounds + 1):
        run(f"round{r}", False)
        run(f"round{r}", True)


if __name__ == "__main__":
    fire.Fire(main)
