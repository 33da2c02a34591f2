"""Meta's original download: params.json + consolidated.NN.pth (model-parallel shards) + tokenizer.model.

Shards are merged as Meta's fairscale layers split them: column-parallel weights (wq, wk, wv, w1, w3,
output) on dim 0, row-parallel ones (wo, w2) on dim 1, and the token embedding on dim 1 in Llama 1/2
(ParallelEmbedding) or dim 0 in Llama 3 (VocabParallelEmbedding), told apart by the shards' shapes.
Shards are memory-mapped, so a tensor is read only when it is converted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from converters.layout import ConversionError, config_error
from jaxllama import models
from jaxllama.core.config import ModelConfig, RopeScaling


def is_meta(path: Path) -> bool:
    return path.is_dir() and (path / "params.json").is_file() and any(path.glob("consolidated.*.pth"))


def _torch():
    try:
        import torch
    except ImportError:
        raise ConversionError(
            "reading Meta .pth checkpoints needs torch: pip install 'jaxllama[meta]' (torch==2.13.0)"
        ) from None
    return torch


class MetaSource:
    format = "meta"

    def __init__(self, path: Path):
        self.path = path
        torch = _torch()
        self.shard_files = sorted(path.glob("consolidated.*.pth"))
        numbers = [int(re.search(r"consolidated\.(\d+)\.pth$", f.name).group(1)) for f in self.shard_files]
        if numbers != list(range(len(numbers))):
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
            raise ConversionError(
                f"{path}: missing shard consolidated.{missing[0]:02d}.pth "
                f"(found {', '.join(f.name for f in self.shard_files)})"
            )
        self.shards = []
        for f in self.shard_files:
            try:
                self.shards.append(torch.load(f, map_location="cpu", mmap=True, weights_only=True))
            except Exception as e:
                raise ConversionError(f"{f}: cannot read as a PyTorch checkpoint ({e})") from None
        params_file = path / "params.json"
        try:
            params = json.loads(params_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConversionError(f"{params_file}: not valid JSON ({e})") from None
        if not isinstance(params, dict):
            raise ConversionError(f"{params_file}: expected a JSON object")
        self.config_file = params_file
        # Fields params.json does not have come from the shapes of these tensors.
        self.config_names = {"vocab_size": "tok_embeddings.weight", "ffn_dim": "layers.0.feed_forward.w1.weight"}
        self.config = self._config(params, params_file)

    def _tensor(self, shard: int, key: str):
        try:
            return self.shards[shard][key]
        except KeyError:
            raise ConversionError(f"{self.shard_files[shard]}: tensor {key!r} is missing") from None

    def _config(self, params: dict, params_file: Path) -> ModelConfig:
        try:
            dim, n_layers, n_heads = params["dim"], params["n_layers"], params["n_heads"]
        except KeyError as e:
            raise ConversionError(f"{params_file}: field {e.args[0]!r} is missing") from None
        emb = [self._tensor(i, "tok_embeddings.weight").shape for i in range(len(self.shards))]
        # Split on the vocabulary (Llama 3) when each shard keeps the full width, else on the width.
        vocab = sum(s[0] for s in emb) if emb[0][1] == dim else emb[0][0]
        ffn_dim = sum(self._tensor(i, "layers.0.feed_forward.w1.weight").shape[0] for i in range(len(self.shards)))
        dtype = str(self._tensor(0, "tok_embeddings.weight").dtype).removeprefix("torch.")
        try:
            scaling = None
            if params.get("use_scaled_rope"):
                scaling = RopeScaling(
                    factor=float(params.get("rope_scaling_factor", 8.0)),
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                )
            default_ctx = 131072 if scaling else (8192 if vocab >= 128000 else 4096)
            return ModelConfig(
                vocab_size=vocab,
                dim=dim,
                n_layers=n_layers,
                n_heads=n_heads,
                n_kv_heads=params.get("n_kv_heads") or n_heads,
                ffn_dim=ffn_dim,
                norm_eps=params.get("norm_eps", 1e-5),
                rope_theta=params.get("rope_theta", 10000.0),
                rope_scaling=scaling,
                max_seq_len=params.get("max_seq_len", default_ctx),
                tie_embeddings="output.weight" not in self.shards[0],
                dtype=dtype,
            )
        except (TypeError, ValueError) as e:
            raise config_error(str(params_file), e, self.config_names) from None

    def _merged(self, key: str, axis: int | None):
        parts = [self._tensor(i, key) for i in range(len(self.shards))]
        if axis is None or len(parts) == 1:
            return parts[0]
        return _torch().cat(parts, dim=axis)

    def locate(self, name: str) -> str:
        return f"{self.path}: {self._key(name)[0]}"

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The merged tensor's shape, from the shards' shapes (nothing is read)."""
        key, axis = self._key(name)
        if key not in self.shards[0]:
            return None
        shapes = [tuple(self._tensor(i, key).shape) for i in range(len(self.shards))]
        if axis is None or len(shapes) == 1:
            return shapes[0]
        return tuple(sum(s[d] for s in shapes) if d == axis else shapes[0][d] for d in range(len(shapes[0])))

    def _key(self, name: str) -> tuple[str, int | None]:
        """The tensor's name in the shards, and the axis they split it on (None: every shard holds it whole)."""
        d = models.declared(self.config, name)
        if d is None or d.meta is None:
            return None, None
        if name == "embedding":
            first = self._tensor(0, d.meta)
            return d.meta, (0 if first.shape[1] == self.config.dim else 1)
        if len(d.shape) == 1:  # a norm
            return d.meta, None
        return d.meta, (1 if d.axes[0] == "embed" else 0)  # row-parallel products give the model's width

    def read(self, name: str) -> np.ndarray:
        key, axis = self._key(name)
        t = self._merged(key, axis)
        torch = _torch()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def extra_files(self) -> dict[str, Path]:
        files = {}
        for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (self.path / name).is_file():
                files[name] = self.path / name
        return files
