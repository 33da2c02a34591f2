"""The engine thread: one thread steps the `EngineLoop` (`engine_loop.py`) while there is
work; the HTTP handlers talk to it only through a thread-safe inbox.

Requests from every connection go into the same engine, so continuous batching runs them together. Each
request's events go back to its handler through a callback; `RequestStream` turns them into an
`asyncio.Queue` on the handler's event loop (fed with `loop.call_soon_threadsafe`). A request that nobody
waits for any more is cancelled, which frees its slot at the next step.

Admission control counts samples (a request asking for n counts n, as each takes a slot): at most
`slots + max_queue` are in flight (running or waiting for a slot); a request that would pass that is refused at once
with `QueueFull`, never left to hang, and one that could never fit, even on an idle server, with `InvalidParameter`
(retrying cannot help it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable

from jaxllama.engine_loop import EngineLoop
from jaxllama.errors import EngineUnavailable, InvalidParameter, QueueFull
from jaxllama.results import Event
from jaxllama.text_engine import TextRequest

__all__ = ["EngineUnavailable", "EngineWorker", "QueueFull", "RequestStream"]


@dataclasses.dataclass
class _Submit:
    id: int
    request: TextRequest
    deliver: Callable[[object], None]
    submitted: float


@dataclasses.dataclass
class _Cancel:
    id: int


@dataclasses.dataclass
class _Pause:
    paused: bool


_STOP = object()


@dataclasses.dataclass
class _Tracked:
    """A request the engine thread is running: where its events go (None once its client is gone)."""

    deliver: Callable[[object], None] | None
    submitted: float
    samples: int = 1  # its n: what it counts in flight
    last_token: float | None = None


class EngineWorker:
    """Runs an `EngineLoop` on its own thread for callers on other threads.

    `metrics` (a `jaxllama.server.metrics.Metrics`, optional) is told about accepted prompts, first tokens,
    later tokens and finished requests.
    """

    def __init__(self, loop: EngineLoop, *, slots: int, max_queue: int = 256, metrics=None):
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue}: must be >= 0")
        self.loop, self.slots, self.max_queue, self.metrics = loop, slots, max_queue, metrics
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._ids = itertools.count(1)
        # Touched only in a turn at the engine loop: its steps (whichever thread takes them) deliver the events.
        self._tracked: dict[int, _Tracked] = {}
        self._paused = False  # the worker's thread only
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ---- any thread -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jaxllama-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30) -> None:
        """Stop the thread after its current step; requests still in flight get `EngineUnavailable`."""
        with self._lock:
            self._stopped = True
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    def submit(self, request: TextRequest, deliver: Callable[[object], None]) -> int:
        """Queue a request (its `n` samples) and return its id. `deliver`
        is called in a step of the engine loop (on the worker's thread, or on another caller's of the same loop) with
        each `Event` of the request, in order (each choice's last carries its
        `Result`; the request's last has `last` set), or once with the exception that ended it (a ValueError if it
        can never run, `EngineUnavailable`). Raises `QueueFull`, `EngineUnavailable` or (more samples than the server
        ever holds: `check_samples`) `InvalidParameter` at once."""
        n = request.n
        self.check_samples(n)
        with self._lock:
            if self.error is not None:
                raise EngineUnavailable(f"the engine failed: {self.error!r}")
            if self._stopped or self._thread is None:
                raise EngineUnavailable("the engine is not running")
            if self._in_flight + n > self.capacity:
                raise QueueFull(
                    f"the server is busy: {self._in_flight} samples are running or waiting "
                    f"({self.slots} slots, at most {self.max_queue} waiting); retry later"
                )
            self._in_flight += n
            rid = next(self._ids)
        self._inbox.put(_Submit(rid, request, deliver, time.perf_counter()))
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request (its client is gone): no more events are delivered, and its slot is freed."""
        self._inbox.put(_Cancel(request_id))

    def pause(self) -> None:
        """Stop stepping the engine after the current step: requests are accepted and wait (counting against
        `max_queue`) until `resume`. For maintenance, and for tests of a full queue. (Another caller of the same
        engine loop, an `LLM` call in this process, still steps it.)"""
        self._inbox.put(_Pause(True))

    def resume(self) -> None:
        self._inbox.put(_Pause(False))

    @property
    def capacity(self) -> int:
        """Samples in flight at most: every slot running, `max_queue` waiting."""
        return self.slots + self.max_queue

    def check_samples(self, samples: int, param: str = "n") -> None:
        """Raise InvalidParameter (naming `param`) if `samples` at once could never be in flight here."""
        if samples > self.capacity:
            raise InvalidParameter(
                f"{param}: {samples} samples at once are more than this server ever holds ({self.slots} slots, at "
                f"most {self.max_queue} waiting); ask for fewer per request",
                param,
            )

    @property
    def in_flight(self) -> int:
        """Samples accepted and not finished (a request's n each): running in a slot or waiting for one."""
        return self._in_flight

    @property
    def running(self) -> int:
        """Samples holding a slot of the engine."""
        return self.loop.busy_slots

    @property
    def waiting(self) -> int:
        return max(0, self._in_flight - self.running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                busy = self.loop.has_work() and not self._paused
                if not self._take_commands(block=not busy):
                    break
                if self._paused or not self.loop.has_work():
                    continue
                self.loop.step()  # each event to its request's `_dispatch`
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request and by /health
            self.error = e
            raise
        finally:
            reason = f"the engine failed: {self.error!r}" if self.error else "the server stopped"
            self._fail_all(EngineUnavailable(reason))

    def _take_commands(self, block: bool) -> bool:
        """Apply the inbox's commands (waiting for one if `block`); False when told to stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, _Submit):
                self._admit(command)
            elif isinstance(command, _Cancel):
                self._cancel(command.id)
            elif isinstance(command, _Pause):
                self._paused = command.paused
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, s: _Submit) -> None:
        tracked = _Tracked(s.deliver, s.submitted, s.request.n)
        with self.loop.turn():  # tracked before another thread's step can finish it
            self._tracked[s.id] = tracked
            try:
                self.loop.submit(s.request, functools.partial(self._dispatch, s.id, tracked), id=_engine_id(s.id))
            except ValueError as e:
                del self._tracked[s.id]
                self._release(s.request.n)
                _safe(s.deliver, e)
                return
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(s.request.prompt))

    def _cancel(self, rid: int) -> None:
        with self.loop.turn():  # no step between the cancel and the check
            tracked = self._tracked.get(rid)
            if tracked is None:  # finished already, or never admitted
                return
            tracked.deliver = None
            self.loop.cancel([_engine_id(rid)])
            if self.loop.running(_engine_id(rid)):
                return
            del self._tracked[rid]  # it was waiting for a slot: dropped at once
        self._release(tracked.samples)
        if self.metrics:
            self.metrics.finished.labels("cancelled").inc()

    def _dispatch(self, rid: int, tracked: _Tracked, event: Event) -> None:
        """Request `rid`'s event: counted, and handed to its client (unless it is gone)."""
        now = time.perf_counter()
        if self.metrics and event.token_ids:
            if tracked.last_token is None:
                self.metrics.ttft.observe(now - tracked.submitted)
            else:
                gap = (now - tracked.last_token) / len(event.token_ids)
                for _ in event.token_ids:
                    self.metrics.itl.observe(gap)
        if event.token_ids:
            tracked.last_token = now
        if event.result is not None and self.metrics:
            self.metrics.completion_tokens.inc(len(event.result.token_ids))
        if event.last:
            del self._tracked[rid]
            self._release(tracked.samples)
            if self.metrics:
                self.metrics.finished.labels(event.result.finish_reason).inc()
        if tracked.deliver is not None:
            _safe(tracked.deliver, event)

    def _release(self, samples: int) -> None:
        with self._lock:
            self._in_flight -= samples

    def _fail_all(self, error: Exception) -> None:
        with self.loop.turn():
            self._fail_tracked(error)

    def _fail_tracked(self, error: Exception) -> None:
        with self._lock:
            self._stopped = True
        while True:  # requests not yet taken from the inbox
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                _safe(command.deliver, error)
        for tracked in self._tracked.values():
            if tracked.deliver is not None:
                _safe(tracked.deliver, error)
        self._tracked.clear()
        with self._lock:
            self._in_flight = 0


def _engine_id(rid: int) -> tuple:
    """A server request's id on the engine loop, apart from the ids of other callers' requests there."""
    return ("server", rid)


def _safe(deliver: Callable[[object], None], item: object) -> None:
    """Deliver, ignoring a receiver that is gone (its event loop closed)."""
    try:
        deliver(item)
    except RuntimeError:
        pass


class RequestStream:
    """One request as its HTTP handler sees it, on the handler's event loop: `await next()` gives its `Event`s
    in order (raising the error that ended it instead); `cancel()` stops it if it has not finished."""

    def __init__(self, worker: EngineWorker, request: TextRequest):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.worker = worker
        self.finished = False
        deliver = lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item)
        self.id = worker.submit(request, deliver)

    async def next(self) -> Event:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.last:
            self.finished = True
        return item

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self.worker.cancel(self.id)
