"""Qwen3 (dense): Llama's layer with an RMSNorm over each head's queries and keys before the rotary embedding, and a
head_dim of its own (not dim / n_heads)."""

from __future__ import annotations

from jaxllama.core.config import ModelConfig
from jaxllama.models import llama
from jaxllama.models.family import Declared, Family


def layer(c: ModelConfig) -> dict[str, Declared]:
    head_norm = (c.head_dim,), ("head_dim",), "ones"
    norms = {
        "attention/q_norm/scale": Declared(
            *head_norm, hf="self_attn.q_norm.weight", gguf="attn_q_norm.weight", rotary="head"
        ),
        "attention/k_norm/scale": Declared(
            *head_norm, hf="self_attn.k_norm.weight", gguf="attn_k_norm.weight", rotary="head"
        ),
    }
    return {name: d._replace(meta=None) for name, d in llama.layer(c).items()} | norms


QWEN3 = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_architecture="qwen3",
    layer=layer,
    gguf_rotary_halves=True,
)
