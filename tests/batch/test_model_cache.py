"""Sources given as --model are converted once into the cache, and again when that conversion was made by another
version of the converters (whose output for the same source differs), lacks a file, or was written before
checkpoints listed their files."""

import json

import pytest

import converters
from jaxllama import default_model
from jaxllama.core.checkpoint import FORMAT, FORMAT_FILE, checkpoint_files
from tests.factories import write_chat_gguf
from tests.helpers.fifo import fifo_instead_of


def test_a_conversion_by_another_converter_version_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLAMA_CACHE", str(tmp_path / "cache"))
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")
    converted = default_model.resolve_model(gguf, progress=False)
    stamp = converted / converters.CONVERTER_FILE
    assert json.loads(stamp.read_text()) == {"version": converters.VERSION}
    written = (converted / "config.json").stat().st_mtime_ns
    assert default_model.resolve_model(gguf, progress=False) == converted  # kept: nothing converted
    assert (converted / "config.json").stat().st_mtime_ns == written
    stamp.write_text(json.dumps({"version": converters.VERSION - 1}))  # as an older jaxllama left it
    assert default_model.resolve_model(gguf, progress=False) == converted
    assert json.loads(stamp.read_text()) == {"version": converters.VERSION}
    assert (converted / "config.json").stat().st_mtime_ns != written


@pytest.mark.parametrize("damage", ["missing tokenizer.json", "unlisted"])
def test_a_conversion_missing_a_file_or_its_list_is_made_again(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("JAXLLAMA_CACHE", str(tmp_path / "cache"))
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")
    converted = default_model.resolve_model(gguf, progress=False)
    if damage == "unlisted":  # as written before format.json listed the checkpoint's files
        (converted / FORMAT_FILE).write_text(json.dumps({"format": FORMAT}) + "\n")
    else:
        (converted / "tokenizer.json").unlink()
    assert default_model.resolve_model(gguf, progress=False) == converted
    assert (converted / "tokenizer.json").is_file() and checkpoint_files(converted) is not None
    assert sorted(p.name for p in converted.parent.iterdir()) == [converted.name]  # nothing left beside it


@pytest.mark.parametrize("name", [FORMAT_FILE, "tokenizer.json", converters.CONVERTER_FILE])
def test_a_conversion_holding_a_fifo_is_made_again(tmp_path, monkeypatch, name):
    """A FIFO in place of one of the conversion's files, whose read would wait for a writer forever: the conversion
    is not whole, and is made again (never read)."""
    monkeypatch.setenv("JAXLLAMA_CACHE", str(tmp_path / "cache"))
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")
    converted = default_model.resolve_model(gguf, progress=False)
    with fifo_instead_of(converted / name) as blocked:
        assert default_model.resolve_model(gguf, progress=False) == converted
    assert not blocked, "resolving the model waited on the FIFO"
    assert (converted / name).is_file() and checkpoint_files(converted) is not None
    assert sorted(p.name for p in converted.parent.iterdir()) == [converted.name]
