"""The model's shape: one `ModelConfig`, written as `config.json` in every converted checkpoint.

Each source format maps its own configuration onto this one (see `converters/`); nothing downstream
reads a source's config directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path

from jaxllama.errors import CheckpointError

CONFIG_FILE = "config.json"
STORAGE_DTYPES = ("bfloat16", "float32", "float16")  # what a converted checkpoint stores its weights in
BLOCK_FORMATS = ("q8_0", "q4_0")  # weights stored as llama.cpp's blocks (`core/blocks.py`)
MAX_POSITIONS = 2**31 - 1
_SIZES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


class ConfigError(ValueError):
    """A ModelConfig value of the wrong type or out of range. `field` names the ModelConfig field, so that a
    source's reader can say which of its own fields it came from."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def _positive_int(name: str, value) -> int:
    # JSON has no integer type of its own: 4096.0 is accepted, 1.5, "8", true and null are not.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(name, f"expected a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(name, f"must be positive, got {value}")
    return int(value)


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(name, f"expected a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(name, f"must be a positive number, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 ``llama3`` rope scaling: long wavelengths stretched by `factor`, short ones kept."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder of the Llama kind: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP; `family` names the variant
    (its parameters: `jaxllama/models/`)."""

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
    # The dtype the weights are stored in, except those named in `stored_as`.
    dtype: str = "bfloat16"
    # The weights stored otherwise, by flat parameter name ("layers_0/attention/wq"): a block format of
    # BLOCK_FORMATS or another of STORAGE_DTYPES. config.json holds it as an object; here it is sorted pairs, so that
    # a config stays hashable (it is a static argument of jitted functions).
    stored_as: tuple[tuple[str, str], ...] = ()
    # The model family (a key of `jaxllama.models.FAMILIES`): which parameters a layer has.
    family: str = "llama"
    # A mixture of experts (Mixtral): each layer's feed-forward block is n_experts blocks of ffn_dim hidden units, of
    # which each token goes through the n_experts_per_token its router scores highest. 0: one dense block.
    n_experts: int = 0
    n_experts_per_token: int = 0

    def __post_init__(self):
        # Types and ranges first: a config read from a file may hold anything, and the checks below divide.
        for name in _SIZES:
            self._set(name, _positive_int(name, getattr(self, name)))
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError("dim", f"{self.dim} is not divisible by n_heads={self.n_heads}")
            self._set("head_dim", self.dim // self.n_heads)
        self._set("head_dim", _positive_int("head_dim", self.head_dim))
        if self.max_seq_len > MAX_POSITIONS:
            raise ConfigError("max_seq_len", f"{self.max_seq_len} is more than {MAX_POSITIONS} (positions are int32)")
        for name in ("norm_eps", "rope_theta"):
            self._set(name, _positive_float(name, getattr(self, name)))
        if isinstance(self.rope_scaling, dict):
            try:
                self._set("rope_scaling", RopeScaling(**self.rope_scaling))
            except TypeError as e:
                raise ConfigError("rope_scaling", str(e).partition("__init__() ")[2] or str(e)) from None
        if self.rope_freq_factors is not None:
            factors = tuple(_positive_float("rope_freq_factors", f) for f in self.rope_freq_factors)
            self._set("rope_freq_factors", factors)
            if len(self.rope_freq_factors) * 2 != self.head_dim:
                raise ConfigError(
                    "rope_freq_factors",
                    f"{len(self.rope_freq_factors)} entries, expected head_dim/2 = {self.head_dim // 2}",
                )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"{self.head_dim} must be even for rotary embeddings")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("tie_embeddings", f"expected true or false, got {self.tie_embeddings!r}")
        if not isinstance(self.dtype, str):
            raise ConfigError("dtype", f"expected a dtype name, got {self.dtype!r}")
        stored = self.stored_as.items() if isinstance(self.stored_as, dict) else self.stored_as
        try:
            stored = tuple(sorted((str(name), form) for name, form in stored))
        except (TypeError, ValueError):
            raise ConfigError("stored_as", f"expected an object of parameter names, got {self.stored_as!r}") from None
        for name, form in stored:
            if form not in STORAGE_DTYPES + BLOCK_FORMATS:
                raise ConfigError(
                    "stored_as", f"{name}: {form!r} is not one of {', '.join(STORAGE_DTYPES + BLOCK_FORMATS)}"
                )
        self._set("stored_as", stored)
        for name in ("n_experts", "n_experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"expected a whole number >= 0, got {value!r}")
        if self.n_experts and not 1 <= self.n_experts_per_token <= self.n_experts:
            raise ConfigError(
                "n_experts_per_token", f"{self.n_experts_per_token}: expected 1 to n_experts={self.n_experts}"
            )
        from jaxllama.models import FAMILIES  # the registry reads configs: imported when one is made

        if self.family not in FAMILIES:
            raise ConfigError("family", f"{self.family!r} is not one of {', '.join(FAMILIES)}")
        if bool(self.n_experts) != FAMILIES[self.family].experts:
            wants = "is a mixture of experts" if FAMILIES[self.family].experts else "has no experts"
            raise ConfigError("n_experts", f"{self.n_experts}: a {self.family} model {wants}")

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    @property
    def n_params(self) -> int:
        """Number of parameters (the output projection counted once when tied), as the family declares them."""
        from jaxllama.models import declarations

        return sum(math.prod(d.shape) for d in declarations(self).values())

    @property
    def active_params(self) -> int:
        """Number of parameters one token's products read: of a mixture of experts, only its own experts'."""
        every_expert = sum(math.prod(shape) for shape in self._expert_shapes())
        return self.n_params - every_expert + self.active_expert_params

    @property
    def active_expert_params(self) -> int:
        """Number of experts' parameters one token's products read: its own experts' (0 without experts)."""
        return sum(math.prod(shape[1:]) for shape in self._expert_shapes()) * self.n_experts_per_token

    def _expert_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the weights stacked by expert ([experts, out, in]; not the router's [experts, dim])."""
        from jaxllama.models import declarations

        return [d.shape for d in declarations(self).values() if d.axes[0] == "experts" and len(d.shape) == 3]

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs for one token attending to `context` earlier positions (2 per multiply-add)."""
        matmul = self.active_params - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        attention = 2 * 2 * self.n_layers * self.n_heads * self.head_dim * context
        return 2.0 * matmul + attention

    def form(self, name: str) -> str:
        """How the parameter of flat name `name` is stored: a dtype name or a block format."""
        return dict(self.stored_as).get(name, self.dtype)

    def with_dtype(self, dtype: str) -> ModelConfig:
        """This model with every weight in `dtype` (what loading with a dtype restores)."""
        return dataclasses.replace(self, dtype=dtype, stored_as=())

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stored_as"] = dict(self.stored_as)
        return d

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
        """The config.json of a converted checkpoint; CheckpointError names the file and the field at fault."""
        path = Path(directory, CONFIG_FILE)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: not found; is {directory} a converted jaxllama checkpoint?") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path}: not readable as JSON ({e})") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
        try:
            config = cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: {e}") from None
        if config.dtype not in STORAGE_DTYPES:
            raise CheckpointError(f"{path}: dtype: {config.dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
        return config


def check_dtype(dtype) -> None:
    """ValueError unless `dtype` is None or a dtype weights may be converted to (`LLM.load(dtype=...)`, --dtype)."""
    if dtype is None:
        return
    import jax.numpy as jnp  # here, not above: the rest of this module is plain Python

    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(STORAGE_DTYPES)}")
