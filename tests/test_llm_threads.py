"""`LLM` called from several threads at once: each call gets the answer it gets alone, and none sees the engine's
arrays freed under it (the engine donates its cache to each step, so two threads stepping it at once would read a
deleted array)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from jaxllama import LLM
from tests.helpers.peak import peak_of
from tests.helpers.server import CHAT, CONTEXT, PROMPT, SLOTS

PROMPTS = [PROMPT, "once upon a time there was a llama", "the quick brown fox jumps over", "one two three four"]


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    # the server tests' engine shape: the compiled programs are the session's already
    return LLM.load(tiny_chat_checkpoint, max_slots=SLOTS, max_context=CONTEXT, compilation_cache=False)


def _at_once(calls) -> list:
    """Run the calls on a thread each, released together."""
    barrier = threading.Barrier(len(calls))

    def one(call):
        barrier.wait()
        return call()

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=300) for f in [pool.submit(one, call) for call in calls]]


def test_four_threads_generating_at_once_get_their_answers_alone(llm):
    """Greedy answers equal the ones each call gets alone; and the calls' requests share the engine's steps."""
    alone = [llm.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS]
    assert len({tuple(a) for a in alone}) > 1  # different answers: the comparison means something
    with peak_of(lambda: llm.engine.running) as most_running:
        for _ in range(3):
            answers = _at_once([lambda p=p: llm.generate(p, max_tokens=12, temperature=0) for p in PROMPTS])
            assert [a.token_ids for a in answers] == alone
    assert most_running[0] > 1


def test_streams_chats_and_scores_from_threads_at_once(llm):
    """Every public way in from threads at once: a stream read piece by piece, a chat, a score, logits."""
    text = llm.generate(PROMPT, max_tokens=10, temperature=0).text
    reply = llm.chat(CHAT, max_tokens=10, temperature=0).text
    score = llm.score([(PROMPT, " and")])[0].logprobs
    ids = llm.encode(PROMPT)
    logits = llm.logits([ids])
    calls = [
        lambda: "".join(llm.generate(PROMPT, max_tokens=10, temperature=0, stream=True)),
        lambda: llm.chat(CHAT, max_tokens=10, temperature=0).text,
        lambda: llm.score([(PROMPT, " and")])[0].logprobs,
        lambda: llm.logits([ids]),
    ]
    for _ in range(3):
        streamed, chatted, scored, computed = _at_once(calls)
        assert streamed == text and chatted == reply
        assert scored == pytest.approx(score, abs=1e-4)
        assert (computed == logits).all()
