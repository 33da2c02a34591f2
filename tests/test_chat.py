"""`jaxllama chat` driven through a pipe: two user turns, then end of input. The streamed replies are
`LLM.chat`'s greedy replies to the same conversation, the second turn carrying the first reply; and those
are the argmax of `LLM.logits` at every step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxllama import LLM
from jaxllama.errors import InvalidParameter
from tests.multiprocess import REPO, process_env

TURNS = ["hello there", "and then?"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    return LLM.load(tiny_chat_checkpoint, max_slots=1, compilation_cache=False)  # the session's cache is already on


def conversation(llm) -> tuple[list[list[dict]], list]:
    """The conversation before each reply, and LLM.chat's greedy replies."""
    messages, before, replies = [], [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        before.append(list(messages))
        replies.append(llm.chat(messages, max_tokens=MAX_TOKENS, temperature=0))
        messages.append({"role": "assistant", "content": replies[-1].text})
    return before, replies


@pytest.mark.slow
def test_chat_through_a_pipe_replies_as_llm_chat(tiny_chat_checkpoint, llm):
    _, replies = conversation(llm)
    alone = llm.chat([{"role": "user", "content": TURNS[1]}], max_tokens=MAX_TOKENS, temperature=0).text
    assert alone != replies[1].text  # the history changes the second reply: comparing it checks the history is kept

    proc = subprocess.run(
        [sys.executable, "-m", "jaxllama.cli", "chat", "--model", str(tiny_chat_checkpoint), "--temperature", "0"]
        + ["--max-tokens", str(MAX_TOKENS)],
        input="".join(turn + "\n" for turn in TURNS),
        cwd=REPO,
        env=process_env(PYTHONIOENCODING="utf-8"),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"you> model> {reply.text}\n" for reply in replies) + "you> \n"


@pytest.mark.slow
def test_greedy_replies_are_the_argmax_of_llm_logits(llm):
    before, replies = conversation(llm)
    for messages, reply in zip(before, replies, strict=True):
        prompt = llm.encode_chat(messages)
        logits = llm.logits([prompt + reply.token_ids])[0]
        assert reply.token_ids == np.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()


def test_sampling_keywords_are_checked_as_request_fields_are(llm, tiny_chat_checkpoint):
    """`LLM.generate` and `LLM.chat` read their sampling keywords through the request pipeline's code."""
    with pytest.raises(InvalidParameter) as e:
        llm.generate("x", top_p=0)
    assert e.value.param == "top_p" and e.value.message == "top_p=0: must be in (0, 1]"
    with pytest.raises(InvalidParameter) as e:
        llm.chat([{"role": "user", "content": "x"}], temperature=True)
    assert e.value.param == "temperature"
    with pytest.raises(TypeError, match="max_completion_tokens"):  # a request field's alias, not a keyword
        llm.generate("x", max_completion_tokens=3)
    short = llm.generate("x", max_tokens=2, temperature=0, stop_token_ids=(5,), seed=None)
    assert len(short.token_ids) <= 2
    assert llm.name == tiny_chat_checkpoint.name
