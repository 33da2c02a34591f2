"""`LLM.score` and prompt log-probabilities: the real SmolLM2's equal transformers' (float32, the same GGUF) to
1e-4; on the tiny model, pairs sharing a context equal the forward pass's log-softmax, and job lines carry the
log-probabilities they ask for, in the server's shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jaxllama import LLM
from jaxllama.batch.runner import JobOptions, run_job
from jaxllama.engine.request import SamplingParams
from tests.helpers.server import CONTEXT, SLOTS

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b",
    "Llamas are domesticated South American camelids.",
]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.slow
def test_smollm2_prompt_logprobs_equal_transformers(smollm2_float32_checkpoint, transformers_smollm2):
    llm = LLM.load(  # a float32 cache, as transformers keeps
        smollm2_float32_checkpoint,
        mesh="data=1,model=1",
        max_slots=4,
        max_context=64,
        kv_cache_dtype="float32",
        compilation_cache=False,
    )
    results = llm.generate(TEXTS, max_tokens=0, prompt_logprobs=3, temperature=0)
    for text, result in zip(TEXTS, results, strict=True):
        ids = llm.encode(text)
        with torch.no_grad():
            ref = log_softmax(transformers_smollm2(torch.tensor([ids])).logits[0].numpy())
        got = result.prompt_logprobs
        assert len(got) == len(ids) - 1 and result.token_ids == [] and result.finish_reason == "length"
        np.testing.assert_allclose([lp for lp, _ in got], [ref[j, ids[j + 1]] for j in range(len(ids) - 1)], atol=1e-4)
        for j, (_, top) in enumerate(got):
            np.testing.assert_allclose([v for _, v in top], np.sort(ref[j])[::-1][:3], atol=1e-4)


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    # The server tests' shape: the same compiled programs.
    return LLM.load(tiny_chat_checkpoint, max_slots=SLOTS, max_context=CONTEXT, compilation_cache=False)


@pytest.mark.slow
def test_score_pairs_and_texts(llm):
    context = "the cat sat on the mat and looked at the dog"
    items = [(context, " and"), (context, " then it slept"), (context, " the"), "the dog sat", llm.encode("a cat")]
    scores = llm.score(items)
    for item, score in zip(items, scores, strict=True):
        if isinstance(item, tuple):
            ids, n = llm.encode(item[0]) + llm.encode(item[1], add_bos=False), len(llm.encode(item[1], add_bos=False))
        else:
            ids = llm.encode(item) if isinstance(item, str) else item
            n = len(ids) - 1
        ref = log_softmax(llm.logits([ids])[0])
        positions = range(len(ids) - n - 1, len(ids) - 1)
        assert score.token_ids == ids[-n:]
        np.testing.assert_allclose(score.logprobs, [ref[j, ids[j + 1]] for j in positions], rtol=1e-6, atol=1e-5)
        assert score.logprob == pytest.approx(sum(ref[j, ids[j + 1]] for j in positions), abs=1e-4)
        assert score.greedy == all(ref[j].argmax() == ids[j + 1] for j in positions)


def test_job_lines_carry_logprobs(llm, tmp_path):
    ids = llm.encode("the cat sat on the mat")
    lines = [
        {"id": "echo", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0},
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        {"id": "many", "prompt": [ids, ids]},
    ]
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_job(llm, job, options=JobOptions(SamplingParams(max_tokens=3, temperature=0.0), quiet=True))
    echo, chat, many = (json.loads(line) for line in (tmp_path / "job.out.jsonl").read_text().splitlines())
    ref = log_softmax(llm.logits([ids])[0])
    assert echo["text"] == llm.decode(ids) and echo["usage"]["completion_tokens"] == 0
    lp = echo["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[j - 1, ids[j]] for j in range(1, len(ids))], atol=1e-5)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    content = chat["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 2 for c in content)
    assert many["error"]["code"] == "invalid_request" and "one prompt" in many["error"]["message"]
