"""The engine's running totals: what it computed and how long it took, for the job summary and benchmarks."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    prefill_calls: int = 0
    prefill_tokens: int = 0  # computed; cached ones are not
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    generated_tokens: int = 0
    slot_steps: int = 0  # active slots summed over decode steps
    compiles: int = 0  # programs compiled (or loaded from the caches)
    compile_s: float = 0.0  # compiling programs, and building the CPU kernels

    def occupancy(self, slots: int) -> float:
        return self.slot_steps / max(1, self.decode_steps * slots)
