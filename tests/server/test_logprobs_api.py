"""Log-probabilities through the server, parsed by the official `openai` client: the completions' legacy shape with
`echo` (the prompt's tokens first, the first null), as lm-evaluation-harness asks for it (`echo`, `max_tokens` 0 or
1, `logprobs`); token-id prompts, several per request; chat's `top_logprobs`. The oracle: the model's own
log-softmax over the whole sequence (`LLM.logits`, which does not touch the engine)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.helpers.server import CHAT, MODEL_NAME, PROMPT


def log_softmax(llm, tokens) -> np.ndarray:
    logits = llm.logits([tokens])[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.slow
def test_echo_of_token_id_prompts_in_the_legacy_shape(live):
    llm = live.llm
    prompts = [llm.encode(PROMPT), llm.encode("the dog sat")]
    r = live.client().completions.create(
        model=MODEL_NAME, prompt=prompts, echo=True, max_tokens=0, logprobs=2, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(prompts, r.choices, strict=True):
        lp = choice.logprobs
        ref = log_softmax(llm, prompt)
        assert choice.text == llm.tokenizer.decode(prompt) and choice.finish_reason == "length"
        assert lp.tokens == [llm.tokenizer.decode([t]) for t in prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([ref[j - 1, prompt[j]] for j in range(1, len(prompt))], abs=1e-4)
        for j in range(1, len(prompt)):
            best = np.argsort(-ref[j - 1], kind="stable")[:2]
            expected = {}
            for t in best:  # of tokens that read the same (byte pieces, say), the most likely
                expected.setdefault(llm.tokenizer.decode([int(t)]), ref[j - 1, t])
            assert lp.top_logprobs[j] == pytest.approx(expected, abs=1e-4)
        assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, prompts))


def test_what_lm_evaluation_harness_parses(live):
    """Its `local-completions` loglikelihood request: echo, max_tokens 1, logprobs 1, and the sum of the
    continuation's token_logprobs[ctxlen:-1] (the last is the generated token's) with its greedy check."""
    llm = live.llm
    context, continuation = llm.encode("the cat sat on the"), llm.encode(" mat", add_bos=False)
    body = {"model": MODEL_NAME, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1}
    body |= {"logprobs": 1, "seed": 1234, "echo": True}
    choice = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    lps, tops = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
    assert len(lps) == len(context + continuation) + 1
    ref = log_softmax(llm, context + continuation)
    positions = range(len(context) - 1, len(context + continuation) - 1)
    expected = sum(ref[j, (context + continuation)[j + 1]] for j in positions)
    assert sum(lps[len(context) : -1]) == pytest.approx(expected, abs=1e-4)
    greedy = all(ref[j].argmax() == (context + continuation)[j + 1] for j in positions)
    assert greedy == all(
        lp == max(top.values()) for lp, top in zip(lps[len(context) : -1], tops[len(context) : -1], strict=True)
    )


def test_echo_streamed_equals_whole(live):
    client = live.client()
    args = dict(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=5, logprobs=3, temperature=0)
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert whole.text.startswith(PROMPT)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [x for lp in streamed for x in lp.token_logprobs] == whole.logprobs.token_logprobs
    assert [x for lp in streamed for x in lp.top_logprobs] == whole.logprobs.top_logprobs
    assert [x for lp in streamed for x in lp.text_offset] == whole.logprobs.text_offset


def test_chat_top_logprobs(live):
    llm = live.llm
    r = live.client().chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4
    )
    content = r.choices[0].logprobs.content
    for c in content:
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].token == c.token  # greedy: the most likely
        assert c.top_logprobs[0].logprob == c.logprob
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert c.top_logprobs[1].bytes == list(c.top_logprobs[1].token.encode())
    first = np.sort(log_softmax(llm, llm.encode_chat(CHAT))[-1])[::-1][:4]
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(first, abs=1e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": [PROMPT, PROMPT], "stream": True}, "stream"),
        ({"prompt": [[1, 2], "x", []]}, "prompt"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_refused(live, body, param):
    path = "chat/completions" if "messages" in body else "completions"
    r = httpx.post(f"{live.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == param


def test_tokenizer_endpoints(live):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, which lm-evaluation-harness's remote tokenizer reads."""
    llm = live.llm
    r = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, timeout=30).json()
    assert r["tokens"] == llm.encode(PROMPT, add_bos=False) and r["count"] == len(r["tokens"])
    assert httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"] == llm.encode(
        PROMPT
    )
    eos = llm.tokenizer.eos_token
    special = httpx.post(f"{live.url}/tokenize", json={"prompt": eos, "add_special_tokens": False}, timeout=30).json()
    assert special["tokens"] == [llm.tokenizer.encode(eos, allow_special=True)[-1]]  # one id, as HF reads it
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": PROMPT}
    bad = httpx.post(f"{live.url}/detokenize", json={"tokens": [llm.config.vocab_size]}, timeout=30)
    assert bad.status_code == 400
    body = rb'{"prompt": "scraped \udc00"}'  # JSON's escape of a lone surrogate, as a scraped text may hold
    surrogate = httpx.post(
        f"{live.url}/tokenize", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert surrogate.status_code == 400 and "lone surrogate" in surrogate.json()["error"]["message"]
    info = httpx.get(f"{live.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == llm.tokenizer.eos_token and info["chat_template"] == llm.template.source
