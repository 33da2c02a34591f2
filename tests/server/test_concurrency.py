"""Many clients on one engine: concurrent streams batched together give the sequential answers; a full queue is
answered 429 at once; a client that goes away frees its slot."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.peak import peak_of
from tests.helpers.server import CHAT, MAX_QUEUE, MODEL_NAME, PROMPT, SLOTS, wait_until


def _question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"tell me about question {i:02d}"}]  # 43 tokens, as long as CHAT


def _stream(client, i: int) -> str:
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=_question(i), max_tokens=10, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.slow
def test_16_concurrent_streams_give_the_sequential_answers(live):
    """16 clients at once on 8 slots: continuous batching runs 8 together and admits each waiting one as a slot
    frees; every answer is the one the same request gets alone."""
    client = live.client()
    start = time.perf_counter()
    sequential = [_stream(client, i) for i in range(16)]
    sequential_s = time.perf_counter() - start

    barrier = threading.Barrier(16)

    def one(i):
        c = live.client()
        barrier.wait()
        return _stream(c, i)

    start = time.perf_counter()
    with peak_of(lambda: live.worker.running, every=0.002) as most_running:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            concurrent_answers = list(pool.map(one, range(16)))
    concurrent_s = time.perf_counter() - start
    print(f"16 streams: sequential {sequential_s:.2f} s, concurrent {concurrent_s:.2f} s")
    assert concurrent_answers == sequential
    assert len(set(sequential)) > 1  # the questions get different answers: the comparison means something
    assert most_running[0] > 1  # the requests shared the engine's decode steps


def test_a_full_queue_is_answered_429_at_once(live):
    """With every slot busy and MAX_QUEUE requests waiting, one more is refused at once; the others finish."""
    worker = live.worker
    worker.pause()  # hold the engine so that the requests stay in flight
    held = SLOTS + MAX_QUEUE
    try:
        with concurrent.futures.ThreadPoolExecutor(held) as pool:
            futures = [
                pool.submit(
                    live.client().chat.completions.create, model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0
                )
                for _ in range(held)
            ]
            wait_until(lambda: worker.in_flight == held, what=f"{held} requests in flight")
            assert httpx.get(f"{live.url}/health", timeout=10).json()["waiting"] == held
            start = time.perf_counter()
            with pytest.raises(openai.RateLimitError) as e:
                live.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
            with pytest.raises(openai.RateLimitError):
                live.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, stream=True)
            assert time.perf_counter() - start < 5
            assert e.value.status_code == 429 and "busy" in e.value.message and e.value.code == "queue_full"
            assert e.value.response.headers["retry-after"] == "1"
            worker.resume()
            answers = [f.result(timeout=120) for f in futures]
    finally:
        worker.resume()
    assert all(a.usage.completion_tokens == 2 for a in answers)
    wait_until(lambda: worker.in_flight == 0, what="the queue to drain")


def test_samples_count_against_the_queue_and_what_never_fits_is_400(live):
    """A request's n samples each take a slot: they count n in flight and in /health's `waiting`; more samples than
    the server ever holds (slots + queue) are refused 400, naming the field, even when idle: retrying cannot help."""
    client, worker, capacity = live.client(), live.worker, SLOTS + MAX_QUEUE
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, n=capacity + 1)
    assert e.value.body["param"] == "n" and "ever holds" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=["x"] * (capacity // 2 + 1), max_tokens=2, n=2)
    assert e.value.body["param"] == "prompt"
    worker.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(client.completions.create, model=MODEL_NAME, prompt="x", max_tokens=2, n=4)
            wait_until(lambda: worker.in_flight == 4, what="4 samples in flight")
            assert httpx.get(f"{live.url}/health", timeout=10).json()["waiting"] == 4
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, n=capacity - 3)
            fits = pool.submit(client.completions.create, model=MODEL_NAME, prompt="x", max_tokens=2, n=capacity - 4)
            wait_until(lambda: worker.in_flight == capacity, what="the queue full of samples")
            worker.resume()
            assert len(held.result(timeout=120).choices) == 4 and len(fits.result(timeout=120).choices) == capacity - 4
    finally:
        worker.resume()
    wait_until(lambda: worker.in_flight == 0, what="the queue to drain")


def _finished(live, reason: str) -> float:
    return live.app.state.metrics.finished.labels(reason)._value.get()


def _idle(live) -> bool:
    llm = live.llm
    return live.worker.in_flight == 0 and not llm.engine.active and not llm.engine.queue and not llm.text_engine.pending


def test_a_stream_closed_by_its_client_frees_its_slot(live):
    worker = live.worker
    cancelled = _finished(live, "cancelled")
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 30, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # the first chunk: the request holds a slot
            worker.pause()  # it cannot finish on its own now
            assert worker.running == 1
        # the connection is closed: the server cancels the request; its slot is freed at the engine's next step
        wait_until(lambda: live.llm.engine.ending, what="the engine to be told")
    finally:
        worker.resume()
    wait_until(lambda: _idle(live), what="the slot to be freed")
    assert _finished(live, "cancelled") == cancelled + 1
    answer = live.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3


def test_a_waiting_request_whose_client_gives_up_is_dropped(live):
    worker = live.worker
    cancelled = _finished(live, "cancelled")
    worker.pause()
    try:
        body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        wait_until(lambda: _idle(live), what="the waiting request to be dropped")  # while the engine is held
    finally:
        worker.resume()
    assert _finished(live, "cancelled") == cancelled + 1
    answer = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3


def test_non_streamed_clients_that_leave_are_cancelled_without_a_traceback(live, caplog):
    """Clients of non-streamed requests for several samples (n > 1) that leave before their answers: their requests
    are cancelled, their slots freed, and the server logs no traceback for them (the gathered collection of a
    request's samples, cancelled, once left its CancelledError unread: "_GatheringFuture exception was never
    retrieved", a traceback a client)."""
    worker, clients, n = live.worker, 5, 3  # 15 samples: every slot running, the rest waiting
    cancelled = _finished(live, "cancelled")
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 28, "temperature": 0, "n": n}  # to the context

    async def leave_early():
        async with httpx.AsyncClient(timeout=60) as http:
            posts = [asyncio.create_task(http.post(f"{live.url}/v1/completions", json=body)) for _ in range(clients)]
            deadline = time.monotonic() + 30
            while worker.running < SLOTS:
                assert time.monotonic() < deadline, "the requests did not start"
                await asyncio.sleep(0.001)
            for post in posts:  # the connections close: each client is gone
                post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(leave_early())
        wait_until(lambda: _idle(live), what="the slots to be freed")
        gc.collect()  # a future never read logs its exception when it is collected
    assert _finished(live, "cancelled") > cancelled
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records if r.levelno >= logging.WARNING)
    assert "never retrieved" not in logged and "Traceback" not in logged and "CancelledError" not in logged, logged
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    answer = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, n=2)
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]
