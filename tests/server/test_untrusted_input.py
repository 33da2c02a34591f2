"""Requests that once stalled or broke the server: a body slow to prepare (templating and tokenizing run off the
event loop, so /health and other clients go on), a lone surrogate escape (a 400 naming the field, not a 500), and
log-probabilities that are not finite numbers (answered as a finite floor, never as JSON's missing NaN)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading

import httpx
import pytest

from jaxllama.protocol.responses import LOGPROB_FLOOR
from jaxllama.text.prompts import PromptEncoder
from tests.helpers.server import CHAT, PROMPT


def test_request_preparation_runs_off_the_event_loop(live, monkeypatch):
    """While one request is being prepared (held here until /health has answered), the server answers others."""
    entered, release = threading.Event(), threading.Event()
    encode_chat = PromptEncoder.encode_chat

    def slow_encode_chat(self, messages, **kwargs):
        entered.set()
        release.wait(60)
        return encode_chat(self, messages, **kwargs)

    monkeypatch.setattr(PromptEncoder, "encode_chat", slow_encode_chat)  # what the server's request pipeline runs
    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{live.url}/v1/chat/completions", json=body, timeout=120)
        try:
            assert entered.wait(60)
            health = httpx.get(f"{live.url}/health", timeout=20)  # times out if preparing blocks the event loop
        finally:
            release.set()
        assert health.status_code == 200
        assert answer.result().status_code == 200


@pytest.mark.parametrize(
    "path, body, param, where",
    [
        ("chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages", "messages[0]"),
        ("completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt", "prompt"),
        ("completions", '{"prompt": "x", "stop": ["ok", "\\udfff"]}', "stop", "stop[1]"),
    ],
)
def test_a_lone_surrogate_is_an_invalid_request_naming_the_field(live, path, body, param, where):
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{live.url}/v1/{path}", content=body.encode(), headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)
    assert error["message"].startswith(where) and "lone surrogate" in error["message"]


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are not numbers there."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


# A repetition penalty this small divides the logits of tokens already seen by ~0: their log-probabilities are NaN.
NAN_LOGPROBS = {"max_tokens": 6, "temperature": 0, "repetition_penalty": 1e-40}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_non_finite_logprobs_are_answered_as_a_finite_floor(live, kind):
    if kind == "chat":
        path, body = "chat/completions", {"messages": CHAT, "logprobs": True, **NAN_LOGPROBS}
    else:
        path, body = "completions", {"prompt": PROMPT, "logprobs": 0, **NAN_LOGPROBS}

    r = httpx.post(f"{live.url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    logprobs = strict_json(r.text)["choices"][0]["logprobs"]
    whole = [t["logprob"] for t in logprobs["content"]] if kind == "chat" else logprobs["token_logprobs"]

    streamed = []
    with httpx.stream("POST", f"{live.url}/v1/{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = strict_json(line[len("data: ") :])["choices"][0]
            if choice.get("logprobs"):
                lp = choice["logprobs"]
                streamed += [t["logprob"] for t in lp["content"]] if kind == "chat" else lp["token_logprobs"]

    assert len(whole) == 6 and streamed == pytest.approx(whole, abs=1e-4)
    assert all(math.isfinite(lp) for lp in whole)
    assert LOGPROB_FLOOR in whole  # the penalty did make some NaN: this checks their answer
