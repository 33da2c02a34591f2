"""Llama (and Mistral, whose checkpoints are Llama's): RMSNorm, rotary embeddings, grouped-query attention with no
biases, a SwiGLU feed-forward block. The family every other here extends."""

from __future__ import annotations

from jaxllama.core.config import ModelConfig
from jaxllama.models.family import Declared, Family


def layer(c: ModelConfig) -> dict[str, Declared]:
    """One decoder layer's parameters: its attention block's, then its feed-forward block's. Weights are (out, in), as
    PyTorch's `Linear` and every source format store them, with the heads split out of the attention matrices."""
    return attention(c) | feed_forward(c)


def attention(c: ModelConfig) -> dict[str, Declared]:
    """The attention block's: its norm, the q, k, v projections (rotated by RoPE) and the output projection."""
    return {
        "attention_norm/scale": Declared(
            (c.dim,),
            ("norm",),
            "ones",
            hf="input_layernorm.weight",
            gguf="attn_norm.weight",
            meta="attention_norm.weight",
        ),
        "attention/wq": Declared(
            (c.n_heads, c.head_dim, c.dim),
            ("heads", "head_dim", "embed"),
            hf="self_attn.q_proj.weight",
            gguf="attn_q.weight",
            meta="attention.wq.weight",
            rotary="heads",
        ),
        "attention/wk": Declared(
            (c.n_kv_heads, c.head_dim, c.dim),
            ("kv_heads", "head_dim", "embed"),
            hf="self_attn.k_proj.weight",
            gguf="attn_k.weight",
            meta="attention.wk.weight",
            rotary="kv_heads",
        ),
        "attention/wv": Declared(
            (c.n_kv_heads, c.head_dim, c.dim),
            ("kv_heads", "head_dim", "embed"),
            hf="self_attn.v_proj.weight",
            gguf="attn_v.weight",
            meta="attention.wv.weight",
        ),
        "attention/wo": Declared(
            (c.dim, c.n_heads, c.head_dim),
            ("embed", "heads", "head_dim"),
            hf="self_attn.o_proj.weight",
            gguf="attn_output.weight",
            meta="attention.wo.weight",
        ),
    }


def feed_forward(c: ModelConfig) -> dict[str, Declared]:
    """The SwiGLU feed-forward block's: its norm, the gate (w1) and up (w3) projections and the down projection (w2)."""
    return {
        "mlp_norm/scale": Declared(
            (c.dim,),
            ("norm",),
            "ones",
            hf="post_attention_layernorm.weight",
            gguf="ffn_norm.weight",
            meta="ffn_norm.weight",
        ),
        "mlp/w1": Declared(  # gate
            (c.ffn_dim, c.dim),
            ("mlp", "embed"),
            hf="mlp.gate_proj.weight",
            gguf="ffn_gate.weight",
            meta="feed_forward.w1.weight",
        ),
        "mlp/w3": Declared(  # up
            (c.ffn_dim, c.dim),
            ("mlp", "embed"),
            hf="mlp.up_proj.weight",
            gguf="ffn_up.weight",
            meta="feed_forward.w3.weight",
        ),
        "mlp/w2": Declared(  # down
            (c.dim, c.ffn_dim),
            ("embed", "mlp"),
            hf="mlp.down_proj.weight",
            gguf="ffn_down.weight",
            meta="feed_forward.w2.weight",
        ),
    }


LLAMA = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    gguf_architecture="llama",
    layer=layer,
)
