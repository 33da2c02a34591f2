"""From the (out_features, in_features) matrices of Meta's reference code to jaxllama's parameter layout (the
same (out, in) order, with heads split out of the attention matrices).

All three source formats are brought to Meta's layout first (Hugging Face's rotary permutation undone;
GGUF tensors already are), then `to_params` reshapes them onto the shapes declared in
`jaxllama.core.model`. A source yields tensors under the canonical names below, one layer at a time.

Canonical names: ``embedding``, ``norm``, ``output``, and per layer ``layers_{i}/{wq,wk,wv,wo,w1,w2,w3,
attention_norm,mlp_norm}``.
"""

from __future__ import annotations

import numpy as np

from jaxllama.core.blocks import Blocks
from jaxllama.core.config import ConfigError, ModelConfig
from jaxllama.errors import CheckpointError

LAYER_TENSORS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "attention_norm", "mlp_norm")


class ConversionError(CheckpointError):
    """A problem with the source checkpoint, in the user's terms (file and tensor)."""


def config_error(where: str, e: ValueError, names: dict[str, str]) -> ConversionError:
    """A ModelConfig value refused, told with the source's own name for the field (`names`: ours -> theirs)."""
    if isinstance(e, ConfigError):
        return ConversionError(f"{where}: {names.get(e.field, e.field)}: {e.problem}")
    return ConversionError(f"{where}: {e}")


def check_source(source, config: ModelConfig) -> None:
    """Compare the config with the tensors the source holds, from their shapes alone (nothing is read), before
    anything is allocated or written: a config that says 10^6 layers, or a width its embedding does not have,
    is refused naming the field instead of being converted for hours.

    `source` gives `shape(name)` (a canonical tensor's shape in Meta's layout, None when absent),
    `locate(name)`, `config_file` and `config_names` (our config field -> the source's name for it)."""
    held = 0
    while source.shape(f"layers_{held}/wq") is not None:
        held += 1
    if held != config.n_layers:
        field = source.config_names.get("n_layers", "n_layers")
        raise ConversionError(f"{source.config_file}: {field} is {config.n_layers}, but the weights hold {held} layers")
    for name in (n for group in canonical_names(config) for n in group):
        shape, expected = source.shape(name), expected_shape(name, config)
        if shape is None:
            raise ConversionError(f"{source.locate(name)}: missing")
        if tuple(shape) != expected:
            raise ConversionError(
                f"{source.locate(name)}: shape {tuple(shape)}, expected {expected} from the model's config"
            )


def param_name(name: str) -> str:
    """The jaxllama parameter a canonical tensor becomes."""
    if name in ("embedding", "output"):
        return name
    if name == "norm":
        return "norm/scale"
    layer, _, kind = name.partition("/")
    if kind in ("wq", "wk", "wv", "wo"):
        return f"{layer}/attention/{kind}"
    if kind in ("w1", "w2", "w3"):
        return f"{layer}/mlp/{kind}"
    if kind in ("attention_norm", "mlp_norm"):
        return f"{layer}/{kind}/scale"
    raise ValueError(f"unknown canonical tensor {name!r}")


def to_params(name: str, w: np.ndarray | Blocks, config: ModelConfig) -> tuple[str, np.ndarray | Blocks]:
    """A canonical tensor in Meta's (out, in) layout (an array, or Blocks of one input dim) -> (jaxllama parameter
    name, the array or Blocks on its shape)."""
    c = config
    key = param_name(name)
    kind = name.partition("/")[2]
    if kind == "wq":
        return key, _reshape(w, (c.n_heads, c.head_dim, c.dim), 1)
    if kind in ("wk", "wv"):
        return key, _reshape(w, (c.n_kv_heads, c.head_dim, c.dim), 1)
    if kind == "wo":
        return key, _reshape(w, (c.dim, c.n_heads, c.head_dim), 2)
    return key, w


def _reshape(w: np.ndarray | Blocks, shape: tuple[int, ...], in_dims: int):
    if not isinstance(w, Blocks):
        return w.reshape(shape)
    out = shape[: len(shape) - in_dims]
    return Blocks(w.quants.reshape(*out, -1), w.scales.reshape(*out, -1), w.format, shape[len(shape) - in_dims :])


def expected_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The Meta-layout (out, in) shape a source must provide for a canonical tensor."""
    c = config
    kind = name.partition("/")[2] if name.startswith("layers_") else name
    return {
        "embedding": (c.vocab_size, c.dim),
        "norm": (c.dim,),
        "output": (c.vocab_size, c.dim),
        "wq": (c.n_heads * c.head_dim, c.dim),
        "wk": (c.n_kv_heads * c.head_dim, c.dim),
        "wv": (c.n_kv_heads * c.head_dim, c.dim),
        "wo": (c.dim, c.n_heads * c.head_dim),
        "w1": (c.ffn_dim, c.dim),
        "w3": (c.ffn_dim, c.dim),
        "w2": (c.dim, c.ffn_dim),
        "attention_norm": (c.dim,),
        "mlp_norm": (c.dim,),
    }[kind]


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo Hugging Face's q/k permutation: HF's converter groups each head's rotary pairs as
    (all first halves, all second halves); Meta's layout interleaves them (pair i = rows 2i, 2i+1)."""
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, in_features).transpose(0, 2, 1, 3).reshape(out_features, in_features)


def canonical_names(config: ModelConfig) -> list[list[str]]:
    """The tensors a source yields, grouped as it should yield them: embeddings, one group per layer, the end."""
    groups = [["embedding"]]
    groups += [[f"layers_{i}/{k}" for k in LAYER_TENSORS] for i in range(config.n_layers)]
    groups.append(["norm"] + ([] if config.tie_embeddings else ["output"]))
    return groups
