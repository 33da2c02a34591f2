"""Mixtral: Llama's attention, and a mixture of experts for a feed-forward block: a router scores `n_experts` SwiGLU
blocks for each token, whose `n_experts_per_token` best each compute it, weighted by the softmax of their scores
(`core/moe.py`). Hugging Face stores each expert's weights apart (`experts.{expert}.w1`: stacked on reading); GGUF as
one tensor of every expert's (`ffn_gate_exps`), under llama.cpp's `llama` architecture with an expert count."""

from __future__ import annotations

from types import MappingProxyType

from jaxllama.core.config import ModelConfig
from jaxllama.models import llama
from jaxllama.models.family import TENSOR_PARALLEL, Declared, Family

# Each expert's weights are Llama's feed-forward weights: by their names here, in Hugging Face's files and in GGUF's.
EXPERTS = {"mlp/w1": ("gate_exps", "w1"), "mlp/w3": ("up_exps", "w3"), "mlp/w2": ("down_exps", "w2")}


def layer(c: ModelConfig) -> dict[str, Declared]:
    declared = {name: d._replace(meta=None) for name, d in llama.layer(c).items()}
    declared["mlp/router"] = Declared(
        (c.n_experts, c.dim), ("experts", "embed"), hf="block_sparse_moe.gate.weight", gguf="ffn_gate_inp.weight"
    )
    for mlp, (name, hf) in EXPERTS.items():
        d = declared.pop(mlp)
        declared[f"mlp/{name}"] = Declared(
            (c.n_experts, *d.shape),
            ("experts", *d.axes),
            hf=f"block_sparse_moe.experts.{{expert}}.{hf}.weight",
            gguf=f"ffn_{name}.weight",
        )
    return declared


MIXTRAL = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    gguf_architecture="llama",
    layer=layer,
    experts=True,
    # every device holds each expert's share of its hidden units ("mlp" over `model`), not whole experts of its own
    sharding=MappingProxyType(TENSOR_PARALLEL | {"experts": None}),
)
