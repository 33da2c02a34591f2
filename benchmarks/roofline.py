"""Prefill and batched decode through the engine on the CPU kernels, as a share of this CPU's peak for the arithmetic
their products run on (`benchmarks.peaks`, measured first in the same run): int16 pairs for the default Q8_0 weights,
int8 quads for `--quantize w8a8`, float32 FMAs for float weights.

- prefill: prompts of each length in `--prompts` (random token ids: no prefix is shared), as many as fill
  `--tokens` prompt tokens, one token generated each; the engine's prefill seconds (`EngineStats.prefill_s`);
- decode: `--decode-rows` requests of `--decode-prompt` tokens decoding `--decode-tokens` tokens each, all at once;
  the engine's decode seconds.

Each is run once to compile, then timed on new prompts. G(FL)OP/s count the model's products (2 per weight per
token; the output layer only for the rows whose logits are computed), then with attention (2 x 2 x heads x head
dimension per attended position per layer) too. "% in blocks": the products against the ceiling that Q8_0's blocks
leave their arithmetic (`peaks`' `*_in_blocks`: each block's sum added in float). "% of roofline": the time the
products and attention would take at the peaks of the arithmetic each runs on (attention: float32 FMAs, or bfloat16
pairs over a bfloat16 cache where the kernels compute it so), over the time taken; the rest is the norms, rotations,
copies, the softmax, and arithmetic short of its peak. Decode also reads the cache, which this leaves out.

    python -m benchmarks.roofline [--model PATH] [--quantize default,w8a8] [--prompts 512,1024,2048]
                                  [--tokens 4096] [--decode-rows 64] [--decode-prompt 256] [--decode-tokens 32]
                                  [--kv-cache-dtype float16|bfloat16|float32]

`--model`: the default model, or any model `jaxllama run --model` takes, e.g. a random-weight GGUF of the Llama 3.2
1B shape (`make_gguf.py 1b`).
"""

from __future__ import annotations

import dataclasses
import functools

import fire
import numpy as np

from benchmarks import peaks
from benchmarks.matmul_bench import _list
from jaxllama import LLM
from jaxllama.backends.cpu import library

# The arithmetic each weight form's products run on (`benchmarks.peaks.FORMS`).
PEAK_OF = {"default": "int16_pairs", "q8_0": "int16_pairs", "w8a8": "int8_quads", "q4_0": "int8_quads"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a model computes per token: its products' weights, the output layer's, attention's per position."""

    layer_weights: int  # q, k, v, o, gate, up, down of every layer
    output_weights: int
    attention_per_position: int  # multiply-adds per attended position per token, every layer

    @classmethod
    def of(cls, config) -> Shape:
        d, hd = config.dim, config.head_dim
        q, kv = config.n_heads * hd, config.n_kv_heads * hd
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * config.ffn_dim
        return cls(per_layer * config.n_layers, d * config.vocab_size, 2 * q * config.n_layers)

    def flops(self, tokens: int, logits_rows: int, positions: int) -> tuple[float, float]:
        """(products, attention) operations for `tokens` tokens attending over `positions` positions in all."""
        products = 2 * (tokens * self.layer_weights + logits_rows * self.output_weights)
        return products, 2 * positions * self.attention_per_position


def _random_prompts(rng, vocab: int, count: int, length: int):
    """A function that gives `count` new prompts of `length` random token ids each call: no prefix is shared."""
    return lambda: [rng.integers(1000, vocab, length).tolist() for _ in range(count)]


def _run(llm, prompts, max_tokens: int) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, prompt tokens computed) of one batch, from the engine's counters; run twice,
    on new prompts each time, the first to compile."""
    for _ in range(2):
        before = dataclasses.replace(llm.stats)
        llm.generate(prompts(), max_tokens=max_tokens, temperature=0, ignore_eos=True)
        after = llm.stats
    computed = after.prefill_tokens - before.prefill_tokens
    return after.prefill_s - before.prefill_s, after.decode_s - before.decode_s, computed


def _report(label: str, seconds: float, tokens: int, flops: tuple[float, float], tops: tuple[float, float, float]):
    peak, ceiling, attention_peak = tops
    rate, total = flops[0] / seconds / 1e9, sum(flops) / seconds / 1e9
    ideal = (flops[0] / peak + flops[1] / attention_peak) / 1e9
    print(
        f"{label:>26} {tokens / seconds:9.0f} {rate:15.1f} {100 * rate / peak:9.0f}% {100 * rate / ceiling:12.0f}%"
        f" {total:15.1f} {100 * ideal / seconds:12.0f}%"
    )


def main(
    model: str | None = None,
    quantize: str = "default,w8a8",
    prompts: str = "512,1024,2048",
    tokens: int = 4096,
    decode_rows: int = 64,
    decode_prompt: int = 256,
    decode_tokens: int = 32,
    kv_cache_dtype: str | None = None,
):
    peak = peaks.measure()
    print("peaks, from registers on every core: " + ", ".join(f"{k} {v:.0f} G(FL)OP/s" for k, v in peak.items()))
    lengths = [int(n) for n in _list(prompts)]
    rng = np.random.default_rng(0)
    for form in _list(quantize):
        context = max(max(lengths), decode_prompt + decode_tokens) + 1
        slots = max(decode_rows, max(1, tokens // min(lengths)))
        quantize = None if form == "default" else form
        llm = LLM.load(model, quantize=quantize, max_slots=slots, max_context=context, kv_cache_dtype=kv_cache_dtype)
        config, top = llm.config, peak[PEAK_OF[form]]
        ceiling = peak[peaks.IN_BLOCKS.get(PEAK_OF[form], PEAK_OF[form])]
        pairs = llm.engine.options.kv_cache_dtype == "bfloat16" and library.attends_in_bfloat16(config.head_dim)
        tops = (top, ceiling, peak["bf16_pairs" if pairs else "float32_fma"])
        shape = Shape.of(config)
        random = functools.partial(_random_prompts, rng, config.vocab_size)
        print(
            f"\n{form}: {config.n_layers} layers, dim {config.dim}; its products' peak {top:.0f} G(FL)OP/s, in its"
            f" blocks {ceiling:.0f}"
        )
        print(
            f"{'work':>26} {'tokens/s':>9} {'products GOP/s':>15} {'% of peak':>10} {'% in blocks':>13}"
            f" {'with attention':>15} {'% of roofline':>13}"
        )
        for length in lengths:
            count = max(1, tokens // length)
            prefill_s, _, computed = _run(llm, random(count, length), 1)
            flops = shape.flops(computed, count, count * length * (length + 1) // 2)
            _report(f"prefill {count} x {length}", prefill_s, computed, flops, tops)
        _, decode_s, _ = _run(llm, random(decode_rows, decode_prompt), decode_tokens + 1)
        rows = decode_rows * decode_tokens
        positions = decode_rows * sum(decode_prompt + i for i in range(1, decode_tokens + 1))
        _report(f"decode {decode_rows} rows", decode_s, rows, shape.flops(rows, rows, positions), tops)
        del llm


if __name__ == "__main__":
    fire.Fire(main)
