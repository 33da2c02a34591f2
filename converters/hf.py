"""Hugging Face folders: config.json + model.safetensors (or shards listed in model.safetensors.index.json).

Hugging Face's conversion script permutes the rows of q_proj and k_proj so that rotary embeddings can
rotate the two halves of each head; `unpermute_rotary` restores Meta's interleaved pairs (with
n_kv_heads for k). Tensors are read one at a time from memory-mapped files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from converters.layout import ConversionError, unpermute_rotary
from jaxllama.core.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
_LAYER_KEYS = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "w1": "mlp.gate_proj",
    "w3": "mlp.up_proj",
    "w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
}


def is_hf(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    """Map a Hugging Face config.json onto ModelConfig; unsupported models are refused by name."""
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in ("llama", "mistral") or (archs and archs[0] not in SUPPORTED_ARCHITECTURES):
        raise ConversionError(
            f"{where}: unsupported architecture {archs[0] if archs else cfg.get('model_type')!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("sliding_window") and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
        raise ConversionError(f"{where}: sliding-window attention is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConversionError(f"{where}: {key}=true is not supported")
    rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
    rope.update(cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif kind != "default":
        raise ConversionError(f"{where}: rope scaling type {kind!r} is not supported (supported: llama3)")
    try:
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            ffn_dim=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim"),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )
    except KeyError as e:
        raise ConversionError(f"{where}: field {e.args[0]!r} is missing") from None
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None


class HFSource:
    format = "hf"

    def __init__(self, path: Path):
        self.path = path
        config_file = path / "config.json"
        try:
            self.config = config_from_hf(json.loads(config_file.read_text()), str(config_file))
        except ValueError as e:
            raise ConversionError(f"{config_file}: not valid JSON ({e})") from None
        self.files = self._weight_map()

    def _weight_map(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.path / f for name, f in weight_map.items()}
            for f in sorted(set(files.values())):
                if not f.is_file():
                    raise ConversionError(f"{index}: lists {f.name}, which is missing")
            return files
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise ConversionError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors weights are supported)"
            )
        with safe_open(single, "numpy") as f:
            return {name: single for name in f.keys()}

    def _key(self, name: str) -> str:
        if name == "embedding":
            return "model.embed_tokens.weight"
        if name == "norm":
            return "model.norm.weight"
        if name == "output":
            return "lm_head.weight"
        layer, _, kind = name.partition("/")
        return f"model.layers.{layer.removeprefix('layers_')}.{_LAYER_KEYS[kind]}.weight"

    def locate(self, name: str) -> str:
        key = self._key(name)
        return f"{self.files.get(key, self.path)}: {key}"

    def read(self, name: str) -> np.ndarray:
        key = self._key(name)
        if key not in self.files:
            raise ConversionError(f"{self.path}: tensor {key!r} is missing")
        file = self.files[key]
        try:
            # Opened per tensor: a handle kept open keeps the file's touched pages mapped, so a converter
            # holding every shard open would end with the whole checkpoint resident.
            with safe_open(file, "numpy") as f:
                w = f.get_tensor(key)
        except Exception as e:
            raise ConversionError(f"{file}: cannot read {key} ({e})") from None
        kind = name.partition("/")[2]
        if kind == "wq" and w.ndim == 2:
            w = unpermute_rotary(w, self.config.n_heads)
        elif kind == "wk" and w.ndim == 2:
            w = unpermute_rotary(w, self.config.n_kv_heads)
        return w

    def extra_files(self) -> dict[str, Path]:
        return {n: self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()}
