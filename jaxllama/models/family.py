"""What a model family is: the parameters it declares, and the names its checkpoints give them.

Every parameter of a family is declared once (`Declared`: its shape, logical axes and initializer, and its names in
Hugging Face, GGUF and Meta files); shapes, shardings and random init (`core/params.py`, `core/linen.py`) and every
converter's tensor names (`converters/`) derive from the declarations. The decoder's math (`core/model.py`) is one
function for every family: a family's features are the parameters it declares (q/k/v biases, per-head q/k norms),
which the math applies where a layer's params hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from jaxllama.core.config import ModelConfig

# A parameter's logical axis -> the mesh axis it is split over (None: replicated): tensor parallelism, the attention
# heads, the MLP's hidden units and the vocabulary split over `model` (`core/sharding.py`).
TENSOR_PARALLEL = MappingProxyType(
    {
        "vocab": "model",
        "embed": None,
        "heads": "model",
        "kv_heads": "model",
        "head_dim": None,
        "mlp": "model",
        "norm": None,
    }
)


class Declared(NamedTuple):
    """One parameter: its shape, its logical axes (`core/sharding.py` maps them onto a mesh), its random init
    ("normal": normal, stddev 0.02; "ones"), and its names in checkpoints (a layer's relative to the layer's
    prefix: "self_attn.q_proj.weight" in "model.layers.0."). `rotary`: Hugging Face stores this tensor's rows
    with each head's rotary pairs as halves, over this many heads ("heads", "kv_heads", or "head": one head's
    dims), where Meta's layout interleaves them (`converters/layout.unpermute_rotary`). A tensor of every expert's
    weights (axes first "experts") is one tensor in GGUF, and one per expert in Hugging Face files, whose name holds
    `{expert}` for the expert's index."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"
    hf: str | None = None
    gguf: str | None = None
    meta: str | None = None
    rotary: str | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of decoders: its name (`ModelConfig.family`), the names Hugging Face's config.json
    (`architectures`, `model_type`) and GGUF (`general.architecture`) give it, and its parameters, whose
    declarations `layer` (one decoder layer's, by names relative to the layer) and the embedding, final norm and
    output make. `gguf_rotary_halves`: its GGUF files keep Hugging Face's q/k row order (llama.cpp rotates such a
    model's halves: its "NEOX" rope), where a Llama GGUF's rows are in Meta's order already. `experts`: its
    feed-forward blocks are a mixture of experts (`ModelConfig.n_experts`), which tells it from a dense family of the
    same GGUF architecture (Mixtral's files say "llama"). `sharding`: the mesh axis each logical axis of its
    parameters is split over."""

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_architecture: str
    layer: Callable[[ModelConfig], dict[str, Declared]]
    gguf_rotary_halves: bool = False
    experts: bool = False
    # every logical axis its parameters name -> a mesh axis (a read-only mapping: no part of the family's hash)
    sharding: Mapping[str, str | None] = dataclasses.field(default_factory=lambda: TENSOR_PARALLEL, hash=False)

    def declarations(self, c: ModelConfig) -> dict[str, Declared]:
        """Every parameter of a model of config `c`, by flat name ("layers_0/attention/wq"), in the order they are
        declared (the order Flax draws their random values in: `core/linen.py`), their checkpoint names whole."""
        embedding, *end = self._ends(c).items()
        flat = dict([embedding])
        for i in range(c.n_layers):
            flat |= self._layer_at(c, i)
        return flat | dict(end)

    def declared(self, c: ModelConfig, name: str) -> Declared | None:
        """One parameter's declaration, by flat name; also of a layer past `c.n_layers` (a source counting the
        layers it holds looks for them). None for a name the family does not declare."""
        layer, _, rest = name.partition("/")
        if layer.startswith("layers_") and layer.removeprefix("layers_").isdigit():
            return self._layer_at(c, int(layer.removeprefix("layers_"))).get(name)
        return self._ends(c).get(name)

    def _layer_at(self, c: ModelConfig, i: int) -> dict[str, Declared]:
        hf, gguf, meta = f"model.layers.{i}.", f"blk.{i}.", f"layers.{i}."
        return {
            f"layers_{i}/{name}": d._replace(
                hf=d.hf and hf + d.hf, gguf=d.gguf and gguf + d.gguf, meta=d.meta and meta + d.meta
            )
            for name, d in self.layer(c).items()
        }

    def _ends(self, c: ModelConfig) -> dict[str, Declared]:
        """The parameters outside the layers: the embedding, then the final norm and the output."""
        table = ((c.vocab_size, c.dim), ("vocab", "embed"))
        ends = {
            "embedding": Declared(
                *table, hf="model.embed_tokens.weight", gguf="token_embd.weight", meta="tok_embeddings.weight"
            ),
            "norm/scale": Declared(
                (c.dim,), ("norm",), "ones", hf="model.norm.weight", gguf="output_norm.weight", meta="norm.weight"
            ),
        }
        if not c.tie_embeddings:
            ends["output"] = Declared(*table, hf="lm_head.weight", gguf="output.weight", meta="output.weight")
        return ends
