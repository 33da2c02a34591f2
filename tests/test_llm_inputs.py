"""What `LLM.generate` refuses, as the job lines and the server do: ValueErrors that name the argument at fault."""

from __future__ import annotations

import pytest

from jaxllama.errors import InvalidParameter, InvalidRequest
from jaxllama.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    return LLM.load(tiny_chat_checkpoint, max_slots=4, max_context=64, compilation_cache=False)


def test_a_lone_surrogate_is_named_where_it_is(llm):
    with pytest.raises(InvalidRequest, match=r"^prompt: holds '\\ud800', a lone surrogate"):
        llm.generate("a\ud800", max_tokens=2)
    with pytest.raises(InvalidRequest, match=r"^prompt\[1\]: holds"):
        llm.generate(["fine", "b\udc00"], max_tokens=2)
    with pytest.raises(InvalidRequest, match=r"stop\[0\]: holds"):
        llm.generate("fine", stop=["\udfff"], max_tokens=2)


@pytest.mark.parametrize("depth", [900, 5000])
def test_a_schema_nested_past_reading_is_named(llm, depth):
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidParameter, match="^guided_json: ") as e:
        llm.generate("a", guided_json=schema, max_tokens=2)
    assert isinstance(e.value, ValueError) and e.value.param == "guided_json"
