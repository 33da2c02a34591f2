"""The one loop every caller runs its requests on (`engine_loop.EngineLoop`), over a stand-in text engine that gives
each running request one event a step: whoever steps, each event goes to its own request's `on_event`; a caller
reading its own events steps for them; a refused submission leaves none of its call's requests running."""

from __future__ import annotations

import contextlib
import threading

import pytest

from jaxllama.engine_loop import EngineLoop
from jaxllama.results import Event


class Steps:
    """A text engine whose request with prompt [k] runs k steps, an event each, the last marked `last`; a prompt
    [0] is refused."""

    def __init__(self):
        self.left, self.on_event, self.cancelled, self.steps = {}, {}, [], 0

    def submit(self, id, request, on_event=None):
        if id in self.left:
            raise ValueError(f"request id {id!r} is already running")
        if request.prompt == [0]:
            raise ValueError("refused")
        self.left[id], self.on_event[id] = request.prompt[0], on_event

    def running(self, id) -> bool:
        return id in self.left

    def cancel(self, id) -> None:
        self.cancelled.append(id)
        self.left.pop(id, None)

    def has_work(self) -> bool:
        return bool(self.left)

    def step(self) -> None:
        self.steps += 1
        for id in list(self.left):
            self.left[id] -= 1
            last = self.left[id] == 0
            if last:
                del self.left[id]
            self.on_event[id](Event(id, f"{id}@{self.steps}", last=last))


def request(steps: int):
    from jaxllama.engine.request import SamplingParams
    from jaxllama.text_engine import TextRequest

    return TextRequest([steps], SamplingParams())


def test_each_event_goes_to_its_own_request_whoever_steps():
    text, mine, theirs = Steps(), [], []
    loop = EngineLoop(text)
    a = loop.submit(request(2), mine.append)
    b = loop.submit(request(3), theirs.append, id="job-line-7")
    assert (a, b) == ("req-1", "job-line-7")
    while loop.has_work():
        loop.step()
    assert [e.delta for e in mine] == ["req-1@1", "req-1@2"] and mine[-1].last
    assert [e.delta for e in theirs] == ["job-line-7@1", "job-line-7@2", "job-line-7@3"] and theirs[-1].last


def test_a_caller_reading_its_events_steps_for_them_and_others_get_theirs():
    text, theirs = Steps(), []
    loop = EngineLoop(text)
    loop.submit(request(5), theirs.append)
    ids, inbox = loop.submit_all([request(1), request(2)])
    events = list(loop.events(ids, inbox))
    assert [e.id for e in events if e.last] == ids and text.steps == 2
    assert len(theirs) == 2 and not theirs[-1].last  # the other request's events came with those steps


def test_a_refused_request_leaves_none_of_its_calls_requests_running():
    text = Steps()
    loop = EngineLoop(text)
    with pytest.raises(ValueError, match="refused"):
        loop.submit_all([request(2), request(0)])
    assert text.cancelled == ["req-1"] and not loop.has_work()


def test_events_closed_early_cancel_what_is_still_running():
    text = Steps()
    loop = EngineLoop(text)
    ids, inbox = loop.submit_all([request(1), request(4)])
    with contextlib.closing(loop.events(ids, inbox)) as events:
        next(events)
    assert text.cancelled == [ids[1]] and not loop.running(ids[1])


def test_threads_take_turns_and_each_gets_all_of_its_events():
    text = Steps()
    loop = EngineLoop(text)
    got, errors = {}, []

    def call(k: int) -> None:
        try:
            ids, inbox = loop.submit_all([request(k)])
            got[k] = [e.delta.split("@")[0] for e in loop.events(ids, inbox)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in (3, 5, 7, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and {k: len(v) for k, v in got.items()} == {3: 3, 5: 5, 7: 7, 2: 2}
    assert all(len(set(v)) == 1 for v in got.values()) and not loop.has_work()


def test_a_turn_is_reentrant():
    loop = EngineLoop(Steps())
    with loop.turn(), loop.turn():
        loop.submit(request(1), lambda e: None)
    assert loop.has_work()


def test_the_servers_thread_and_another_caller_share_the_loop():
    """The server's worker steps the loop on its thread while a caller in the same process steps it for its own
    requests: each gets all of its events, whichever thread's step gave them, and the worker's count of requests in
    flight comes back to zero."""
    from jaxllama.server.worker import EngineWorker

    loop = EngineLoop(Steps())
    worker = EngineWorker(loop, slots=4, max_queue=64)
    worker.start()
    served, done = {}, threading.Event()

    def deliver(rid, event):
        served.setdefault(rid, []).append(event)
        if sum(1 for events in served.values() if events[-1].last) == 20:
            done.set()

    try:
        for k in range(20):
            rid = worker.submit(request(1 + k % 4), lambda event, k=k: deliver(k, event))
            if k % 3 == 0:
                ids, inbox = loop.submit_all([request(2)])
                assert [e.last for e in loop.events(ids, inbox)] == [False, True]
        assert done.wait(10), served
        assert {k: len(v) for k, v in served.items()} == {k: 1 + k % 4 for k in range(20)} and rid == 20
        assert worker.error is None and worker.in_flight == 0
    finally:
        worker.stop()
