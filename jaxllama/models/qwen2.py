"""Qwen2 and Qwen2.5: Llama's layer with biases on the q, k and v projections (none on the output's)."""

from __future__ import annotations

from jaxllama.core.config import ModelConfig
from jaxllama.models import llama
from jaxllama.models.family import Declared, Family


def layer(c: ModelConfig) -> dict[str, Declared]:
    biases = {
        "attention/bq": Declared(
            (c.n_heads, c.head_dim),
            ("heads", "head_dim"),
            hf="self_attn.q_proj.bias",
            gguf="attn_q.bias",
            rotary="heads",
        ),
        "attention/bk": Declared(
            (c.n_kv_heads, c.head_dim),
            ("kv_heads", "head_dim"),
            hf="self_attn.k_proj.bias",
            gguf="attn_k.bias",
            rotary="kv_heads",
        ),
        "attention/bv": Declared(
            (c.n_kv_heads, c.head_dim), ("kv_heads", "head_dim"), hf="self_attn.v_proj.bias", gguf="attn_v.bias"
        ),
    }
    return {name: d._replace(meta=None) for name, d in llama.layer(c).items()} | biases


QWEN2 = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_architecture="qwen2",
    layer=layer,
    gguf_rotary_halves=True,
)
