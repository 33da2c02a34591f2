"""`EngineOptions`: how an engine is sized and run, as one frozen value. It is made where a user's choices come in
(a command's flags, `LLM.load`'s keywords), checked once there, and passed whole to the `Engine`, which fills in
what the model, the mesh and the backend decide (`resolved`) and hands it to the model runner (`ModelRunner`).

    options = EngineOptions(max_slots=16, kv_cache_dtype="bfloat16")  # InvalidOption here for a bad value
    engine = Engine(config, params, mesh, options, eos_ids=[2])
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxllama import backends
from jaxllama.engine import buckets, kvcache
from jaxllama.errors import InvalidOption, is_int

# Decoder layers per compiled program (`step.py`): SmolLM2's 30 layers run as 6 calls of one program.
LAYERS_PER_PROGRAM = 5
# Decode steps per host round trip, where not chosen: on an accelerator several (the host's work is large against a
# step); on a CPU one (the step dominates, and a finished slot is refilled sooner).
DECODE_STEPS = {"cpu": 1}
ACCELERATOR_DECODE_STEPS = 8


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What sizes and runs an engine; None: chosen by `resolved` for the model, mesh and backend.

    max_slots: requests generating at once (rounded up to a multiple of the mesh's `data` axis).
    max_context: positions per slot (at most the model's; None: the model's, or on an accelerator what fits).
    decode_steps: tokens per decode call, with no host round trip between them.
    quantize: int8 weights made at load (`backends.QUANTIZATIONS`); None: the weights as stored.
    kv_cache_dtype: the KV cache's dtype by name (`kvcache.DTYPES`); None: the backend's choice
      (`Ops.cache_dtype`: float16 on the CPU kernels for float32 weights, else the weights').
    page_size: the KV cache's positions per page, 0 for a contiguous cache; None: the backend's (`Ops.page_size`:
      paged where a kernel reads the pages, on a TPU or GPU mesh of data=1).
    step_tokens: tokens a step computes (its decode rows' and prompts'), where the backend runs a prefill and a
      decode step as one call (`ModelRunner.joins_decode`): the prompts past them wait, a longer one computed in
      chunks over steps, so that a long prompt does not hold up the running requests' next tokens (vLLM's chunked
      prefill).
    layers_per_program: decoder layers per compiled program.
    min_cache: a contiguous cache's first length in positions (it grows by buckets).
    cpu_kernels: on one CPU device, run the CPU kernels where they build (else XLA's operations everywhere);
      `quantize` q8_0 and w8a8 need them.
    """

    max_slots: int = buckets.DEFAULT_SLOTS
    max_context: int | None = None
    decode_steps: int | None = None
    quantize: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = None
    step_tokens: int = buckets.STEP_TOKENS
    layers_per_program: int = LAYERS_PER_PROGRAM
    min_cache: int = buckets.MIN_BUCKET
    cpu_kernels: bool = True

    def __post_init__(self):
        backends.check_quantization(self.quantize)
        kvcache.dtype(self.kv_cache_dtype, None)
        for name in ("max_slots", "step_tokens", "layers_per_program", "min_cache"):
            _check_count(name, getattr(self, name))
        for name in ("max_context", "decode_steps"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name))
        if self.page_size is not None and not (is_int(self.page_size) and self.page_size >= 0):
            raise InvalidOption("page_size", self.page_size, "must be a whole number of positions (0: contiguous)")

    def resolved(self, max_seq_len: int, data: int, platform: str, cache_dtype, page_size: int) -> EngineOptions:
        """These options with every choice made: slots a multiple of the mesh's `data` axis, the context at most the
        model's `max_seq_len`, the decode steps of the devices' `platform`, the cache's dtype as resolved for the
        weights (`cache_dtype`) and its page size (`page_size`, the backend's, where not chosen)."""
        steps = self.decode_steps or DECODE_STEPS.get(platform, ACCELERATOR_DECODE_STEPS)
        return dataclasses.replace(
            self,
            max_slots=buckets.slot_count(self.max_slots, data),
            max_context=min(self.max_context or max_seq_len, max_seq_len),
            decode_steps=steps,
            kv_cache_dtype=jnp.dtype(cache_dtype).name,
            page_size=page_size if self.page_size is None else self.page_size,
        )


def _check_count(name: str, value) -> None:
    if not (is_int(value) and value >= 1):
        raise InvalidOption(name, value, "must be a positive integer")
