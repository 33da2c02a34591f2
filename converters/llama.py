"""Convert a checkpoint of a Llama-like family (`jaxllama/models/`) from a Meta download, a Hugging Face folder or a
GGUF file into a jaxllama checkpoint.

    python -m converters.llama SRC OUT [--dtype bfloat16|float16|float32] [--quantize q8_0|q4_0]
                               [--format meta|hf|gguf] [--overwrite]

Weights keep the precision they are stored in (`storage`): a Hugging Face or Meta checkpoint its dtype; a GGUF file
its Q8_0 and Q4_0 tensors as those blocks, other block types requantized once to Q8_0 (`quantize.NEAREST`), F16 and
BF16 tensors as bfloat16, F32 ones as float32. `--dtype` stores every weight in that dtype instead (blocks
dequantized); `--quantize` quantizes every product's weight and the embedding into Q8_0 or Q4_0 blocks, from any
source. Norms stay float32 (or `--dtype`).

The conversion streams: one layer is read, reshaped and written at a time, so peak memory stays near a
couple of layers plus the embedding whatever the model's size. OUT appears only when complete: everything is written
into `.OUT.tmp-PID-*` beside it, format.json (listing every file with its size) last, then renamed into place. With
--overwrite the new folder is swapped with the old in one step where the system can (Linux's renameat2), else in two
that the next command to read or write OUT completes if this one was killed between them: OUT is the old checkpoint or
the new one, whole, at every instant (`jaxllama.core.folders`). Loading refuses a checkpoint missing a file its
format.json lists.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import fire
import numpy as np
from tqdm import tqdm

from converters import CONVERTER_FILE, VERSION
from converters.gguf_file import GGUFSource, is_gguf
from converters.hf import HFSource, is_hf
from converters.layout import ConversionError, canonical_names, check_source, to_params
from converters.meta import MetaSource, is_meta
from converters.quantize import NATIVE, gguf_form, quantize
from jaxllama.core.checkpoint import CheckpointWriter
from jaxllama.core.chips import skip_absent_tpu
from jaxllama.core.config import BLOCK_FORMATS, ModelConfig
from jaxllama.core.config import STORAGE_DTYPES as DTYPES
from jaxllama.core.params import block_in_dims, check_forms
from jaxllama.errors import CheckpointError

SOURCES = {"meta": (MetaSource, is_meta), "hf": (HFSource, is_hf), "gguf": (GGUFSource, is_gguf)}


def open_source(src: str | Path, format: str | None = None):
    """Detect (or take) the source format and open it."""
    path = Path(src)
    if not path.exists():
        raise ConversionError(f"{path}: no such file or directory")
    if format is not None:
        if format not in SOURCES:
            raise ConversionError(f"--format {format!r}: expected one of {', '.join(SOURCES)}")
        return SOURCES[format][0](path)
    for cls, detect in SOURCES.values():
        if detect(path):
            return cls(path)
    raise ConversionError(
        f"{path}: not a Llama checkpoint: expected a Meta folder (params.json + consolidated.*.pth), "
        "a Hugging Face folder (config.json + *.safetensors) or a .gguf file"
    )


def convert(
    src: str | Path,
    out: str | Path,
    dtype: str | None = None,
    format: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    quantize: str | None = None,
) -> Path:
    """Convert SRC into a checkpoint folder OUT; returns OUT. Raises ConversionError (a CheckpointError) on bad
    input, FileExistsError when OUT exists (or another conversion put it there meanwhile) and not `overwrite`."""
    source = open_source(src, format)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if quantize is not None and quantize not in BLOCK_FORMATS:
        raise ConversionError(f"--quantize {quantize!r}: expected one of {', '.join(BLOCK_FORMATS)}")
    check_source(source, source.config)
    config = storage(source, dtype, quantize)
    groups = canonical_names(config)
    bar = tqdm(total=sum(map(len, groups)), unit="tensor", desc=f"converting {Path(src).name}", disable=not progress)
    with bar, CheckpointWriter(out, config, overwrite=overwrite) as writer:
        for group in groups:
            tensors = {}
            for name in group:
                tensors[name] = to_params(name, _read(source, name, config.form(name)), config)
                bar.update()
            writer.write(tensors)
            del tensors
        for name, content in source.extra_files().items():
            if isinstance(content, Path):
                writer.copy_file(content, name)
            else:
                writer.write_file(name, content)
        writer.write_file(CONVERTER_FILE, json.dumps({"version": VERSION}) + "\n")
        writer.commit()
    return Path(out)


def storage(source, dtype: str | None = None, quantize: str | None = None) -> ModelConfig:
    """The source's config with the form each weight will be stored in (`ModelConfig.dtype` and `stored_as`), by
    the rules of this module's docstring."""
    config = source.config
    names = [n for group in canonical_names(config) for n in group]
    if quantize is not None:
        dense = dtype or "float32"
        forms = {n: quantize for n in names if block_in_dims(n) is not None}
    elif source.format == "gguf" and dtype is None:
        dense = "float32"
        forms = {n: gguf_form(source.tensor_type(n), block_in_dims(n) is not None) for n in names}
    else:
        dense, forms = dtype or _storage_dtype(config.dtype), {}
    config = dataclasses.replace(config, dtype=dense, stored_as={n: f for n, f in forms.items() if f != dense})
    try:
        check_forms(config)
    except ValueError as e:
        raise ConversionError(f"{source.path}: cannot store it so: {e}") from None
    return config


def _storage_dtype(source_dtype: str) -> str:
    return source_dtype if source_dtype in DTYPES else "float32"


def _read(source, name: str, form: str):
    """A parameter, in Meta's layout, as it will be stored: an array, or Blocks of `form` (the source's own
    blocks where it holds them in that form, else quantized here)."""
    if form not in BLOCK_FORMATS:
        return source.read(name)
    if source.format == "gguf" and NATIVE.get(source.tensor_type(name)) == form:
        return source.read_blocks(name)
    return quantize(source.read(name), form)


def main(
    src: str,
    out: str,
    dtype: str | None = None,
    quantize: str | None = None,
    format: str | None = None,
    overwrite: bool = False,
):
    """Convert a Llama checkpoint into a jaxllama checkpoint.

    Args:
      src: a Meta download folder, a Hugging Face folder, or a .gguf file.
      out: the output folder (created; must not exist, or be empty, unless --overwrite).
      dtype: store every weight in bfloat16, float16 or float32 (GGUF blocks dequantized; default: as the source
        stores them, see the module's docstring).
      quantize: q8_0 or q4_0: store every product's weight and the embedding as llama.cpp's blocks of that type.
      format: meta, hf or gguf (default: detected).
      overwrite: replace OUT if it exists (OUT stays whole, the old checkpoint or the new, until the new is in place).
    """
    skip_absent_tpu()  # libtpu installed, no TPU here: keep jax from starting (and printing) its TPU backend
    try:
        convert(src, out, dtype=dtype, format=format, overwrite=overwrite, quantize=quantize)
    except (CheckpointError, OSError) as e:  # bad input, or OUT not writable: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    np.seterr(all="ignore")
    fire.Fire(main)
