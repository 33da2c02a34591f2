"""Batch invariance through the server: every request to a busy server is answered as a server answers it alone.

The job-level test (tests/batch/test_invariance.py) runs a seeded mixed job through the batch runner; this one sends
the same kind of lines (`mixed_job`: lengths around the cache's buckets, shared prefixes, n > 1, stops,
log-probabilities, structured output) to a server, all at once, some streamed, beside four long requests whose
clients leave mid-way: two streams closed after their first chunks, two clients of whole answers gone while their
requests run. Those hold every slot when the others arrive, then free them at different points of the run, so that
the others are admitted into slots that a cancellation freed, beside requests still running. Each answer is then
compared with the answer the same request gets alone from a freshly started server on a freshly loaded model: on the
CPU kernels the same to the bit, but for its id, creation time, timings and the prompt tokens it found cached. The
server must be left idle, every slot free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from jaxllama import LLM
from jaxllama.batch.jobs import read_line
from jaxllama.protocol.requests import ENDPOINTS
from tests.batch import test_invariance as job_invariance
from tests.batch.test_invariance import BACKENDS, LINES, SEED, TOLERANCE, comparable, differences, mixed_job

invariance_model = job_invariance.invariance_model  # the job tests' model fixture, which pytest finds here

BACKEND = "cpu-kernels"  # one device, prompts past 96 tokens a step computed in chunks, 4 slots
STREAMED = 3  # every third request is streamed (with its usage chunk)
# The clients that leave: (kind, streamed, when they leave: once every other request is in flight, or once that many
# answers have come back). Each asks for a long answer (near the context's end, eos ignored), so that only its client
# ends it: it holds a slot from the start of the run until then.
LEAVING = [
    ("chat", True, "sent"),
    ("completion", True, 1),
    ("chat", False, min(3, LINES)),
    ("completion", False, min(6, LINES)),
]
LONG = {"max_tokens": 1900, "temperature": 0, "ignore_eos": True}


def server_request(line: dict, stream: bool) -> tuple[str, dict]:
    """A job line as a server request: the path and body of its kind, read as the batch runner reads the line
    (`JobLine.request`), without its "id", which the server does not know."""
    kind, body = read_line(json.dumps(line), 1).request()
    body = {k: v for k, v in body.items() if k != "id"}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return ENDPOINTS[kind], body


def leaving_line(i: int, kind: str) -> dict:
    text = f"tell me story {i}"
    return {"messages": [{"role": "user", "content": text}]} if kind == "chat" else {"prompt": text}


@contextlib.contextmanager
def serving(llm, max_queue: int = 256):
    """The server on `llm`, uvicorn in a thread of this process (so that the test sees its engine); yields the app
    and its URL; stopped, its engine thread joined, at the end."""
    import uvicorn

    from jaxllama.server.app import create_app

    app = create_app(llm, max_queue=max_queue)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("the server did not start")
            time.sleep(0.01)
        yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def assembled(chunks: list[dict]) -> dict:
    """A streamed answer put together: each choice's text (a chat's content), log-probabilities (their pieces' lists
    joined), finish and stop reasons, and the usage chunk's usage; so that what a stream delivers is compared
    whole, however it was cut into chunks."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for piece in chunk["choices"]:
            choice = choices.setdefault(piece["index"], {"text": "", "logprobs": None, "finish_reason": None})
            choice["text"] += (piece["delta"].get("content") or "") if "delta" in piece else piece["text"]
            if piece["logprobs"] is not None:
                joined = choice["logprobs"] = choice["logprobs"] or {k: None for k in piece["logprobs"]}
                for key, values in piece["logprobs"].items():
                    joined[key] = values if joined[key] is None else joined[key] + (values or [])
            if piece["finish_reason"] is not None:
                choice.update(finish_reason=piece["finish_reason"], stop_reason=piece["stop_reason"])
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


async def answer(http: httpx.AsyncClient, url: str, path: str, body: dict) -> dict:
    """The answer to one request, without what differs from one answer to the next (its id and creation time,
    timings, the prompt tokens found cached): the body of a whole answer, a stream `assembled`."""
    if not body.get("stream"):
        response = await http.post(url + path, json=body)
        assert response.status_code == 200, response.text
        whole = response.json()
        return comparable({k: v for k, v in whole.items() if k not in ("id", "created")})
    async with http.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        data = [line[len("data: ") :] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    return comparable(assembled(chunks))


async def until(condition, what: str, timeout: float = 120) -> None:
    """Poll `condition` on the event loop (the clients' tasks run meanwhile); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def busy_run(url: str, worker, requests: list[tuple[str, dict]], leaving: list[tuple[str, dict]]) -> list[dict]:
    """Every request at once on one server, beside the `leaving` ones: those first, until each holds a slot, then the
    others; each leaving client goes away at its point of the run (`LEAVING`), a stream after its first chunks.
    Returns the answers."""
    answered = 0

    async def one(path, body):
        nonlocal answered
        out = await answer(http, url, path, body)
        answered += 1
        return out

    def left_at(when) -> bool:
        samples = sum(body.get("n", 1) for _, body in requests) + len(leaving)
        return worker.in_flight == samples if when == "sent" else answered >= when

    async def stream_then_leave(path, body, when) -> None:
        read = 0
        async with http.stream("POST", url + path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    read += 1
                    assert line != "data: [DONE]", "a leaving stream finished before its client left"
                    if read >= 3 and left_at(when):
                        break  # the client leaves: the connection is closed

    async def post_then_leave(path, body, when) -> None:
        post = asyncio.create_task(http.post(url + path, json=body))
        await until(lambda: left_at(when) or post.done(), f"the point where a client leaves ({when})")
        assert not post.done(), "a leaving request was answered before its client left"
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post

    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=httpx.Limits(max_connections=None)) as http:
        leavers = [
            asyncio.create_task((stream_then_leave if body.get("stream") else post_then_leave)(path, body, when))
            for (path, body), (_, _, when) in zip(leaving, LEAVING, strict=True)
        ]
        await until(lambda: worker.running == len(leaving), "the leaving requests to hold their slots")
        answers = await asyncio.gather(*(one(path, body) for path, body in requests))
        await asyncio.gather(*leavers)
        return answers


def idle(app) -> bool:
    llm, worker = app.state.llm, app.state.worker
    return worker.in_flight == 0 and not llm.engine.active and not llm.engine.queue and not llm.text_engine.pending


async def alone(url: str, path: str, body: dict) -> dict:
    async with httpx.AsyncClient(timeout=120) as http:
        return await answer(http, url, path, body)


@pytest.mark.slow
def test_every_request_to_a_busy_server_is_answered_as_it_is_alone(invariance_model):
    options = BACKENDS[BACKEND]
    lines = mixed_job(LINES, SEED + 10)  # not the job tests' lines
    requests = [server_request(line, i % STREAMED == STREAMED - 1) for i, line in enumerate(lines)]
    leaving = [server_request({**leaving_line(i, kind), **LONG}, stream) for i, (kind, stream, _) in enumerate(LEAVING)]
    samples = sum(body.get("n", 1) for _, body in requests) + len(leaving)
    llm = LLM.load(invariance_model, **options)
    assert type(llm.engine.ops).__name__ == "CpuOps" and llm.slots == len(LEAVING)
    start = time.perf_counter()
    with serving(llm, max_queue=samples) as (app, url):
        answers = asyncio.run(busy_run(url, app.state.worker, requests, leaving))
        busy_s = time.perf_counter() - start

        deadline = time.monotonic() + 30
        while not idle(app):
            assert time.monotonic() < deadline, "the server did not become idle"
            time.sleep(0.01)
        # each leaving request was cancelled, none ran to its length
        assert app.state.metrics.finished.labels("cancelled")._value.get() == len(LEAVING)
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok", "running": 0, "waiting": 0}
        # every slot free: a request of one sample a slot is answered
        final = {"prompt": "the cat", "max_tokens": 3, "temperature": 0, "n": llm.slots}
        last = httpx.post(f"{url}{ENDPOINTS['completion']}", json=final, timeout=30).json()
        assert [c["finish_reason"] for c in last["choices"]] == ["length"] * llm.slots, last

    start = time.perf_counter()
    found = []
    for (path, body), together in zip(requests, answers, strict=True):
        with serving(LLM.load(invariance_model, **options)) as (_, url):
            by_itself = asyncio.run(alone(url, path, body))
        if diff := differences(together, by_itself, TOLERANCE[BACKEND]):
            found.append(f"{path} {json.dumps(body)[:200]}: {diff[:3]}")
    alone_s = time.perf_counter() - start
    print(f"{len(requests)} requests: busy server {busy_s:.1f} s, alone {alone_s:.1f} s")
    assert not found, f"{len(found)} of {len(requests)} requests answered otherwise on a busy server:\n" + "\n".join(
        found[:10]
    )
