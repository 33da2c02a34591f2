"""Sources given as --model are converted once into the cache, and again when that conversion was made by another
version of the converters (whose output for the same source differs)."""

import json

import converters
from jaxllama import default_model
from tests.factories import write_chat_gguf


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
