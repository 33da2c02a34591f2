"""Hugging Face folders: config.json + model.safetensors (or shards listed in model.safetensors.index.json).

Hugging Face's conversion script permutes the rows of q_proj and k_proj so that rotary embeddings can
rotate the two halves of each head; `unpermute_rotary` restores Meta's interleaved pairs in every tensor the family
declares `rotary` (q and k, and their biases or per-head norms where it has them). The family is the one
`jaxllama.models` registers for config.json's `architectures`. Tensors are read one at a time, each into memory of
its own (`read_tensor`).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from converters.layout import ConversionError, config_error, rotary_heads, unpermute_rotary
from jaxllama import models
from jaxllama.core.config import ModelConfig, RopeScaling

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
# ModelConfig's fields by the names config.json gives them, for messages.
CONFIG_NAMES = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "head_dim": "head_dim",
    "n_experts": "num_local_experts",
    "n_experts_per_token": "num_experts_per_tok",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "dtype": "torch_dtype",
}


def is_hf(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    """Map a Hugging Face config.json onto ModelConfig; unsupported models are refused by name."""
    archs = cfg.get("architectures") or [None]
    family = models.for_hf(archs[0], cfg.get("model_type"))
    if family is None:
        raise ConversionError(
            f"{where}: unsupported architecture {archs[0] or cfg.get('model_type')!r} "
            f"(supported: {', '.join(models.hf_architectures())})"
        )
    window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    windowed = cfg.get("use_sliding_window", True)  # Qwen's configs name a window they do not use
    if windowed and isinstance(window, int) and isinstance(positions, int) and window < positions:
        raise ConversionError(f"{where}: sliding-window attention is not supported")
    if cfg.get("mlp_bias"):
        raise ConversionError(f"{where}: mlp_bias=true is not supported")
    try:
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
        rope.update(cfg.get("rope_scaling") or {})
    except (TypeError, ValueError):
        raise ConversionError(f"{where}: rope_parameters and rope_scaling must be objects") from None
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "llama3":
        try:
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConversionError(f"{where}: rope_scaling: field {e.args[0]!r} is missing") from None
        except (TypeError, ValueError) as e:
            raise ConversionError(f"{where}: rope_scaling: {e}") from None
    elif kind != "default":
        raise ConversionError(f"{where}: rope scaling type {kind!r} is not supported (supported: llama3)")
    try:
        config = ModelConfig(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            ffn_dim=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim"),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            family=family.name,
            n_experts=cfg.get("num_local_experts", 0) if family.experts else 0,
            n_experts_per_token=cfg.get("num_experts_per_tok", 0) if family.experts else 0,
        )
    except KeyError as e:
        raise ConversionError(f"{where}: field {e.args[0]!r} is missing") from None
    except ValueError as e:
        raise config_error(where, e, CONFIG_NAMES) from None
    if cfg.get("attention_bias") and models.declared(config, "layers_0/attention/bq") is None:
        raise ConversionError(f"{where}: attention_bias=true is not supported for {family.name}")
    return config


class HFSource:
    format = "hf"

    def __init__(self, path: Path):
        self.path = path
        self.config_file = path / "config.json"
        self.config_names = CONFIG_NAMES
        cfg = _read_json(self.config_file)
        if not isinstance(cfg, dict):
            raise ConversionError(f"{self.config_file}: expected a JSON object")
        self.config = config_from_hf(cfg, str(self.config_file))
        self.files, self.shapes = self._headers(self._weight_files())

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: no weight_map object")
            files = sorted({self.path / str(f) for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ConversionError(f"{index}: lists {f.name}, which is missing")
            return files
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise ConversionError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors weights are supported)"
            )
        return [single]

    @staticmethod
    def _headers(files: list[Path]) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
        """Each tensor's file and shape, from the files' headers. Opening a file checks its header against the
        bytes that follow (every tensor's shape, dtype and offsets within the data), so a truncated, garbled or
        lying file is refused here, by name, before anything is converted."""
        where, shapes = {}, {}
        for file in files:
            try:
                with safe_open(file, "numpy") as f:
                    for key in f.keys():
                        where[key], shapes[key] = file, tuple(f.get_slice(key).get_shape())
            except Exception as e:  # safetensors raises its own SafetensorError, and OSError
                raise ConversionError(f"{file}: not a valid safetensors file ({e})") from None
        return where, shapes

    def _key(self, name: str) -> str | None:
        d = models.declared(self.config, name)
        return d and d.hf

    def locate(self, name: str) -> str:
        key = self._key(name)
        return f"{self.files.get(key, self.path)}: {key}"

    def _experts(self, name: str) -> list[str] | None:
        """The tensors of a parameter stacked from one tensor per expert, in expert order; None for one tensor."""
        key = self._key(name)
        if key is None or "{expert}" not in key:
            return None
        return [key.format(expert=e) for e in range(self.config.n_experts)]

    def shape(self, name: str) -> tuple[int, ...] | None:
        keys = self._experts(name)
        if keys is None:
            return self.shapes.get(self._key(name))
        shapes = {self.shapes.get(k) for k in keys}
        return None if None in shapes or len(shapes) > 1 else (len(keys), *shapes.pop())

    def read(self, name: str) -> np.ndarray:
        experts = self._experts(name)
        keys = experts or [self._key(name)]
        for key in keys:
            if key not in self.files:
                raise ConversionError(f"{self.path}: tensor {key!r} is missing")
        try:
            parts = [read_tensor(self.files[key], key) for key in keys]
        except (OSError, ValueError, KeyError) as e:
            raise ConversionError(f"{self.locate(name)}: cannot read it ({e})") from None
        w = parts[0] if experts is None else np.stack(parts)
        if (heads := rotary_heads(name, self.config)) is not None:
            w = unpermute_rotary(w, heads)
        return w

    def extra_files(self) -> dict[str, Path]:
        return {n: self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()}


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def read_tensor(file: Path, key: str) -> np.ndarray:
    """One tensor of a safetensors file, read into memory of its own: the file is read, not mapped (a mapping keeps
    every page read resident while it lives, so a shard of several GB would end wholly in memory). The header was
    checked against the file when the source was opened (`HFSource._headers`)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[key]
        start, end = entry["data_offsets"]
        f.seek(8 + size + start)
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        data = np.fromfile(f, dtype=np.uint8, count=end - start)
    return data.view(dtype).reshape(entry["shape"])


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
