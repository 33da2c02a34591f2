"""Known model shapes by name (`llama-3.1-8b`), for sizing a model before its weights are at hand: `jaxllama compile`
checks whether a model fits a target and how fast it would run from its config alone. Each entry is the model's own
published configuration (its Hugging Face `config.json`) as a `ModelConfig`, weights in bfloat16.
"""

from __future__ import annotations

from jaxllama.core.config import ModelConfig, RopeScaling


def _llama3(dim, n_layers, n_heads, ffn_dim, tie, factor, max_seq_len=131072) -> ModelConfig:
    return ModelConfig(
        vocab_size=128256,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor, 1.0, 4.0, 8192),
        max_seq_len=max_seq_len,
        tie_embeddings=tie,
        norm_eps=1e-5,
    )


SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        ffn_dim=1536,
        rope_theta=100000.0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),  # fmt: skip
    "llama-3.2-1b": _llama3(2048, 16, 32, 8192, tie=True, factor=32.0),
    "llama-3.2-3b": _llama3(3072, 28, 24, 8192, tie=True, factor=32.0),
    "llama-3.1-8b": _llama3(4096, 32, 32, 14336, tie=False, factor=8.0),
    "llama-3.1-70b": _llama3(8192, 80, 64, 28672, tie=False, factor=8.0),
    "llama-3.1-405b": _llama3(16384, 126, 128, 53248, tie=False, factor=8.0),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=32768,
        family="qwen2",
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936,
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=12288,
        head_dim=128,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=40960,
        family="qwen3",
    ),
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_theta=1000000.0,
        max_seq_len=32768,
        family="mixtral",
        n_experts=8,
        n_experts_per_token=2,
    ),
}


def known_shape(name: str) -> ModelConfig | None:
    """The config of a known shape name (any case), or None."""
    return SHAPES.get(name.lower())
