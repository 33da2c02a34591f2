"""Mixtral: Llama's attention, and a mixture of experts for a feed-forward block: a router scores `n_experts` SwiGLU
blocks for each token, whose `n_experts_per_token` best each compute it, weighted by the softmax of their scores
(`core/moe.py`). Hugging Face stores each expert's weights apart (`experts.{expert}.w1`: stacked on reading); GGUF as
one tensor of every expert's (`ffn_gate_exps`), under llama.cpp's `llama` architecture with an expert count."""

from __future__ import annotations

from jaxllama.core.config import ModelConfig
from jaxllama.models import llama
from jaxllama.models.family import Declared, Family

MLP = ("mlp/w1", "mlp/w3", "mlp/w2")


def layer(c: ModelConfig) -> dict[str, Declared]:
    experts = {
        "mlp/router": Declared(
            (c.n_experts, c.dim), ("experts", "embed"), hf="block_sparse_moe.gate.weight", gguf="ffn_gate_inp.weight"
        ),
        "mlp/gate_exps": Declared(
            (c.n_experts, c.ffn_dim, c.dim),
            ("experts", "mlp", "embed"),
            hf="block_sparse_moe.experts.{expert}.w1.weight",
            gguf="ffn_gate_exps.weight",
        ),
        "mlp/up_exps": Declared(
            (c.n_experts, c.ffn_dim, c.dim),
            ("experts", "mlp", "embed"),
            hf="block_sparse_moe.experts.{expert}.w3.weight",
            gguf="ffn_up_exps.weight",
        ),
        "mlp/down_exps": Declared(
            (c.n_experts, c.dim, c.ffn_dim),
            ("experts", "embed", "mlp"),
            hf="block_sparse_moe.experts.{expert}.w2.weight",
            gguf="ffn_down_exps.weight",
        ),
    }
    dense = {name: d._replace(meta=None) for name, d in llama.layer(c).items() if name not in MLP}
    return dense | experts


MIXTRAL = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    gguf_architecture="llama",
    layer=layer,
    experts=True,
)
