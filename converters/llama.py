"""Convert a Llama checkpoint (Meta download, Hugging Face folder, or GGUF file) into a jaxllama checkpoint.

    python -m converters.llama SRC OUT [--dtype bfloat16|float32] [--format meta|hf|gguf] [--overwrite]

The conversion streams: one layer is read, reshaped and written at a time, so peak memory stays near a
couple of layers plus the embedding whatever the model's size. OUT appears only when complete.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import fire
import numpy as np
from tqdm import tqdm

from converters.gguf_file import GGUFSource, is_gguf
from converters.hf import HFSource, is_hf
from converters.layout import ConversionError, canonical_names, check_source, to_params
from converters.meta import MetaSource, is_meta
from jaxllama.core.checkpoint import CheckpointWriter
from jaxllama.core.config import STORAGE_DTYPES as DTYPES
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
) -> Path:
    """Convert SRC into a checkpoint folder OUT; returns OUT. Raises ConversionError (a CheckpointError) on bad
    input, FileExistsError when OUT exists."""
    source = open_source(src, format)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config = dataclasses.replace(source.config, dtype=dtype or _storage_dtype(source.config.dtype))
    check_source(source, config)
    groups = canonical_names(config)
    bar = tqdm(total=sum(map(len, groups)), unit="tensor", desc=f"converting {Path(src).name}", disable=not progress)
    with bar, CheckpointWriter(out, config, overwrite=overwrite) as writer:
        for group in groups:
            tensors = {}
            for name in group:
                key, value = to_params(name, source.read(name), config)  # shapes checked by check_source
                tensors[key] = value
                bar.update()
            writer.write(tensors)
            del tensors
        for name, content in source.extra_files().items():
            if isinstance(content, Path):
                writer.copy_file(content, name)
            else:
                writer.write_file(name, content)
        writer.commit()
    return Path(out)


def _storage_dtype(source_dtype: str) -> str:
    return source_dtype if source_dtype in DTYPES else "float32"


def main(src: str, out: str, dtype: str | None = None, format: str | None = None, overwrite: bool = False):
    """Convert a Llama checkpoint into a jaxllama checkpoint.

    Args:
      src: a Meta download folder, a Hugging Face folder, or a .gguf file.
      out: the output folder (created; must not exist unless --overwrite).
      dtype: storage dtype: bfloat16, float16 or float32 (default: the source's; float32 for GGUF).
      format: meta, hf or gguf (default: detected).
      overwrite: replace OUT if it exists.
    """
    try:
        convert(src, out, dtype=dtype, format=format, overwrite=overwrite)
    except (CheckpointError, OSError) as e:  # bad input, or OUT not writable: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    np.seterr(all="ignore")
    fire.Fire(main)
