"""From the (out_features, in_features) matrices of Meta's reference code to jaxllama's parameter layout (the
same (out, in) order, with heads split out of the attention matrices).

Every source format is brought to Meta's layout first (Hugging Face's rotary permutation undone, `unpermute_rotary`;
a Llama GGUF's tensors already are), then `to_params` reshapes them onto the shapes their family declares
(`jaxllama/models/`). A source yields each parameter under its flat name ("layers_0/attention/wq"), finding it in its
files by the name the declaration gives it there, one layer at a time (`canonical_names`).
"""

from __future__ import annotations

import math

import numpy as np

from jaxllama.core.blocks import Blocks
from jaxllama.core.config import ConfigError, ModelConfig
from jaxllama.core.params import block_in_dims
from jaxllama.errors import CheckpointError
from jaxllama.models import declarations


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

    `source` gives `shape(name)` (a parameter's shape in Meta's layout, None when absent),
    `locate(name)`, `config_file` and `config_names` (our config field -> the source's name for it)."""
    held = 0
    while source.shape(f"layers_{held}/attention/wq") is not None:
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


def to_params(name: str, w: np.ndarray | Blocks, config: ModelConfig) -> np.ndarray | Blocks:
    """A parameter in Meta's (out, in) layout (an array, or Blocks of one input dim) -> the array or Blocks on its
    declared shape."""
    shape, in_dims = declarations(config)[name].shape, block_in_dims(name)
    return _reshape(w, shape, in_dims) if in_dims is not None else w.reshape(shape)


def _reshape(w: np.ndarray | Blocks, shape: tuple[int, ...], in_dims: int):
    if not isinstance(w, Blocks):
        return w.reshape(shape)
    out = shape[: len(shape) - in_dims]
    return Blocks(w.quants.reshape(*out, -1), w.scales.reshape(*out, -1), w.format, shape[len(shape) - in_dims :])


def expected_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The Meta-layout shape a source must provide for a parameter: (out, in) for a product's weight and the
    embedding, flat for a norm or a bias, (experts, out, in) for every expert's weights."""
    declared = declarations(config)[name]
    shape, in_dims = declared.shape, block_in_dims(name)
    if in_dims is None:
        return shape if declared.axes[0] == "experts" else (math.prod(shape),)
    return (math.prod(shape[: len(shape) - in_dims]), math.prod(shape[len(shape) - in_dims :]))


def rotary_heads(name: str, config: ModelConfig) -> int | None:
    """Over how many heads a parameter's rows hold rotary pairs (`Declared.rotary`), or None."""
    rotary = declarations(config)[name].rotary
    return {None: None, "heads": config.n_heads, "kv_heads": config.n_kv_heads, "head": 1}[rotary]


def unpermute_rotary(w: np.ndarray | Blocks, n_heads: int) -> np.ndarray | Blocks:
    """Undo Hugging Face's q/k permutation of the rows (axis 0) of a weight, bias or per-head norm: HF's converter
    groups each head's rotary pairs as (all first halves, all second halves); Meta's layout interleaves them
    (pair i = rows 2i, 2i+1). Blocks are rows of blocks: their quants and scales move with their rows."""
    if isinstance(w, Blocks):
        return Blocks(unpermute_rotary(w.quants, n_heads), unpermute_rotary(w.scales, n_heads), w.format, w.in_shape)
    rows, rest = w.shape[0], w.shape[1:]
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, 2, pairs, *rest).swapaxes(1, 2).reshape(rows, *rest)


def canonical_names(config: ModelConfig) -> list[list[str]]:
    """The parameters a source yields, grouped as it should yield them: the embedding, one group per layer, the
    final norm and output."""
    groups: dict[str, list[str]] = {}
    for name in declarations(config):
        groups.setdefault(name.split("/")[0] if name.startswith("layers_") else name, []).append(name)
    layers = [groups.pop(f"layers_{i}") for i in range(config.n_layers)]
    embedding = groups.pop("embedding")
    return [embedding, *layers, [n for names in groups.values() for n in names]]
