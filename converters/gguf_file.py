"""GGUF files (llama.cpp): metadata under `{arch}.*`, tensors `token_embd`, `blk.N.*`, `output_norm`, `output`.

Every tensor type the `gguf` library dequantizes is accepted (F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants,
...); Q8_0 and Q4_0 tensors can also be read as the blocks they are (`read_blocks`). The family is the one
`jaxllama.models` registers for `general.architecture`. For a Llama, llama.cpp's converter already permuted q/k back
to Meta's interleaved rotary layout, so they are used as they are; a family whose llama.cpp rope rotates halves (Qwen)
keeps Hugging Face's order, undone here as for a Hugging Face folder. A `rope_freqs`
tensor (Llama 3.1 rope scaling as llama.cpp stores it) becomes `ModelConfig.rope_freq_factors`. The tokenizer
is rebuilt from the file's vocabulary (`jaxllama.text.gguf_vocab`), so the converted checkpoint needs nothing
but itself.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import gguf
import numpy as np

from converters.layout import ConversionError, config_error, rotary_heads, unpermute_rotary
from converters.quantize import NATIVE
from jaxllama import models
from jaxllama.core.blocks import Blocks, from_gguf
from jaxllama.core.config import ModelConfig


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


class GGUFSource:
    format = "gguf"

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:
            raise ConversionError(f"{path}: cannot read as GGUF ({e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config_file = path
        self.config_names = self._config_names(self.field("general.architecture"))
        self.config = self._config()

    @staticmethod
    def _config_names(arch) -> dict[str, str]:
        """ModelConfig's fields by the metadata keys they are read from, for messages."""
        keys = {
            "dim": "embedding_length",
            "n_layers": "block_count",
            "n_heads": "attention.head_count",
            "n_kv_heads": "attention.head_count_kv",
            "ffn_dim": "feed_forward_length",
            "head_dim": "attention.key_length",
            "norm_eps": "attention.layer_norm_rms_epsilon",
            "rope_theta": "rope.freq_base",
            "max_seq_len": "context_length",
            "vocab_size": "vocab_size",
            "n_experts": "expert_count",
            "n_experts_per_token": "expert_used_count",
        }
        return {field: f"{arch}.{key}" for field, key in keys.items()} | {"rope_freq_factors": "rope_freqs.weight"}

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        experts = self.field(f"{arch}.expert_count", 0)
        self.family = models.for_gguf(arch, experts)
        if self.family is None:
            supported = ", ".join(sorted({f.gguf_architecture for f in models.FAMILIES.values()}))
            with_experts = f" with {experts} experts" if experts else ""
            raise ConversionError(
                f"{self.path}: unsupported architecture {arch!r}{with_experts} (supported: {supported})"
            )
        try:
            n_heads = int(self.field(f"{arch}.attention.head_count"))
            dim = int(self.field(f"{arch}.embedding_length"))
            vocab = self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens", []))
            if not vocab:
                vocab = self.tensors["token_embd.weight"].shape[-1]
            factors = None
            if "rope_freqs.weight" in self.tensors:
                factors = tuple(self._dequantize("rope_freqs.weight").tolist())
            kind = self.field(f"{arch}.rope.scaling.type", "none")
            if kind not in ("none", None) and factors is None:
                raise ConversionError(f"{self.path}: rope scaling type {kind!r} is not supported")
            return ModelConfig(
                vocab_size=int(vocab),
                dim=dim,
                n_layers=int(self.field(f"{arch}.block_count")),
                n_heads=n_heads,
                n_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", n_heads)),
                ffn_dim=int(self.field(f"{arch}.feed_forward_length")),
                head_dim=self.field(f"{arch}.attention.key_length"),
                norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
                rope_freq_factors=factors,
                max_seq_len=int(self.field(f"{arch}.context_length", 4096)),
                tie_embeddings="output.weight" not in self.tensors,
                dtype="float32",
                family=self.family.name,
                n_experts=int(experts),
                n_experts_per_token=int(self.field(f"{arch}.expert_used_count", 0)),
            )
        except TypeError:
            raise ConversionError(f"{self.path}: required {arch}.* metadata is missing") from None
        except ValueError as e:
            raise config_error(str(self.path), e, self.config_names) from None

    def _key(self, name: str) -> str | None:
        d = models.declared(self.config, name)
        return d and d.gguf

    def _rotary_heads(self, name: str) -> int | None:
        """Over how many heads the tensor's rows are in Hugging Face's rotary order, which a family whose llama.cpp
        rope rotates halves keeps (`Family.gguf_rotary_halves`); None where they are in Meta's."""
        return rotary_heads(name, self.config) if self.family.gguf_rotary_halves else None

    def locate(self, name: str) -> str:
        return f"{self.path}: {self._key(name)}"

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(self._key(name))
        # GGUF lists dimensions fastest-first; row-major numpy order is the reverse.
        return None if t is None else tuple(int(d) for d in reversed(t.shape))

    def _dequantize(self, key: str) -> np.ndarray:
        t = self.tensors.get(key)
        if t is None:
            raise ConversionError(f"{self.path}: tensor {key!r} is missing")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ConversionError(
                f"{self.path}: tensor {key} has type {t.tensor_type.name}, which the gguf library cannot dequantize"
            ) from None
        # GGUF lists dimensions fastest-first; row-major numpy order is the reverse.
        return np.asarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))

    def tensor_type(self, name: str) -> gguf.GGMLQuantizationType:
        return self.tensors[self._key(name)].tensor_type

    def read(self, name: str) -> np.ndarray:
        """The tensor in float32 (dequantized)."""
        w = self._dequantize(self._key(name))
        self._release()
        return w if (heads := self._rotary_heads(name)) is None else unpermute_rotary(w, heads)

    def read_blocks(self, name: str) -> Blocks:
        """A tensor stored in a block type jaxllama keeps (`quantize.NATIVE`), as those blocks: copied, not decoded."""
        t = self.tensors[self._key(name)]
        w = from_gguf(t.data, NATIVE[t.tensor_type], tuple(int(d) for d in reversed(t.shape)))
        self._release()
        return w if (heads := self._rotary_heads(name)) is None else unpermute_rotary(w, heads)

    def _release(self) -> None:
        # The reader maps the whole file; drop the pages read so far from this process, or a converted
        # model would end with the whole GGUF resident.
        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def extra_files(self) -> dict[str, str]:
        from jaxllama.text.gguf_vocab import tokenizer_files_from_gguf

        files = dict(tokenizer_files_from_gguf(self.reader))
        eos = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        generation = {
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": sorted({int(i) for i in eos if i is not None}),
        }
        files["generation_config.json"] = json.dumps(generation, indent=2) + "\n"
        return files
