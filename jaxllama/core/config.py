"""The model's shape: one `ModelConfig`, written as `config.json` in every converted checkpoint.

Each source format maps its own configuration onto this one (see `converters/`); nothing downstream
reads a source's config directly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 ``llama3`` rope scaling: long wavelengths stretched by `factor`, short ones kept."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of the rotary frequencies (GGUF's `rope_freqs` tensor), length head_dim/2.
    rope_freq_factors: tuple[float, ...] | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # The dtype the weights are stored in; the runtime dtype is chosen at load time.
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_freq_factors is not None:
            object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in self.rope_freq_factors))
            if len(self.rope_freq_factors) * 2 != self.head_dim:
                raise ValueError(
                    f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                    f"expected head_dim/2 = {self.head_dim // 2}"
                )
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def n_params(self) -> int:
        """Number of parameters (the output projection counted once when tied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        out = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * layer + self.dim + out

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs for one token attending to `context` earlier positions (2 per multiply-add)."""
        matmul = self.n_params - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        attention = 2 * 2 * self.n_layers * self.n_heads * self.head_dim * context
        return 2.0 * matmul + attention

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config fields: {', '.join(unknown)}")
        return cls(**d)

    def save(self, directory: str | Path) -> None:
        Path(directory, CONFIG_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ModelConfig:
        path = Path(directory, CONFIG_FILE)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: not found; is {directory} a converted jaxllama checkpoint?") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None
