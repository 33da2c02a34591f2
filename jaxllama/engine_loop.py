"""The one loop that runs requests on a process's engine: the `LLM` API's calls (from any number of threads), a job's
lines (`batch/runner.py`) and the server's requests (`server/worker.py`) all submit to it and step it.

Each request is submitted with the `on_event` its events go to; each `step` runs one step of the engine and hands
every event it gives to its request's `on_event`, whoever's request it is and whichever caller stepped. A caller that
waits for its own requests' events steps while it has none (`events`); the job runner steps until its lines are
answered; the server's thread steps while there is work.

One thread at a time uses the engine (it donates its cache to each step: two threads stepping at once would read a
freed array), first come first served: each use takes a ticket, so that a thread that steps again at once does not
keep the others from submitting, and a turn lasts one step, so that between steps a thread takes the events another's
step gave it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

from jaxllama.results import Event
from jaxllama.text_engine import TextEngine, TextRequest


class EngineLoop:
    """Steps a `TextEngine` for every caller, delivering each request's events to its own `on_event`."""

    def __init__(self, text_engine: TextEngine):
        self.text_engine = text_engine
        self._next_id = 0
        # `_user` is the thread whose turn it is (None: nobody's), `_depth` how deep in its own uses.
        self._turn = threading.Condition()
        self._user: int | None = None
        self._depth = 0
        self._serving = self._next_ticket = 0  # the ticket whose turn it is; the next one to give (equal: no queue)
        self._spent: set[int] = set()  # tickets used, or given up waiting (interrupted): skipped

    # ---- submitting and stepping ------------------------------------------------------------------

    def submit(self, request: TextRequest, on_event: Callable[[Event], None], id=None):
        """Queue a request, its events to go to `on_event` (in order; the last has `last` set), under `id` (default:
        one made here) -> its id; raises (naming the problem) if it can never run."""
        with self.turn():
            if id is None:
                self._next_id += 1
                id = f"req-{self._next_id}"
            self.text_engine.submit(id, request, on_event=on_event)
        return id

    def step(self) -> None:
        """One step of the engine: every event it gives goes to its request's `on_event`."""
        with self.turn():
            self.text_engine.step()

    def has_work(self) -> bool:
        with self.turn():
            return self.text_engine.has_work()

    def cancel(self, ids) -> None:
        """End the requests `ids` that are still running (a request waiting for a slot is dropped without events)."""
        with self.turn():
            for rid in ids:
                if self.text_engine.running(rid):
                    self.text_engine.cancel(rid)

    def running(self, id) -> bool:
        with self.turn():
            return self.text_engine.running(id)

    @property
    def busy_slots(self) -> int:
        """Requests holding a decode slot."""
        return self.text_engine.engine.running

    # ---- a caller that reads its own events -------------------------------------------------------

    def submit_all(self, requests: Sequence[TextRequest]) -> tuple[list, collections.deque]:
        """Submit `requests`, all or none (one refused: the ones before it are cancelled, and the error raised), their
        events to go to one new inbox -> their ids and the inbox (read it with `events`). Submitted in one turn: a
        step of another thread's may give their first events next."""
        inbox, request_ids = collections.deque(), []
        with self.turn():
            try:
                for request in requests:
                    request_ids.append(self.submit(request, inbox.append))
            except BaseException:  # the ones before it must not run on unread
                self.cancel(request_ids)
                raise
        return request_ids, inbox

    def events(self, request_ids: Sequence, inbox: collections.deque) -> Iterator[Event]:
        """The events of the submitted `request_ids` (from their `inbox`), in order, until each has had its last,
        stepping the engine as needed; the events of other callers' requests that those steps give go to theirs.
        Closed before the end (a stream its reader dropped, an error): the requests not finished are cancelled."""
        open_ids = set(request_ids)
        try:
            while open_ids:
                if not inbox:
                    self._step_for(inbox, open_ids)
                    continue
                event = inbox.popleft()
                if event.last:
                    open_ids.discard(event.id)
                yield event
        finally:
            if open_ids:
                self.cancel(open_ids)

    def _step_for(self, inbox: collections.deque, open_ids: set) -> None:
        """Step the engine once for a caller waiting for its events in `inbox`; or, while another thread uses the
        engine, wait for it to finish (its step may bring this caller's events)."""
        with self._turn:
            if self._serving != self._next_ticket:  # a thread's turn, or some waiting: this call's events may come
                self._turn.wait()
                return
        with self.turn():
            if inbox:  # another thread's step, just before this turn, brought them
                return
            if not self.text_engine.has_work():  # never, unless a request was dropped without its events
                raise RuntimeError(f"the engine has no work left for requests {sorted(open_ids)}")
            self.text_engine.step()

    # ---- turns ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self):
        """Use the engine: wait for this thread's turn (after the threads that asked before it), then hold it until
        the block ends. Re-entrant: a thread may nest its own uses, as a dropped stream's clean-up in the middle of a
        step does."""
        me = threading.get_ident()
        with self._turn:
            if self._user != me:
                ticket = self._next_ticket
                self._next_ticket += 1
                try:
                    self._turn.wait_for(lambda: self._serving == ticket)
                except BaseException:  # KeyboardInterrupt: the turn must pass on without this thread
                    self._spent.add(ticket)
                    self._pass_turn()
                    raise
                self._user = me
            self._depth += 1
        try:
            yield
        finally:
            with self._turn:
                self._depth -= 1
                if self._depth == 0:
                    self._user = None
                    self._spent.add(self._serving)
                    self._pass_turn()

    def _pass_turn(self) -> None:
        """Hand the turn to the first ticket not abandoned (or to nobody); called holding `_turn`."""
        while self._serving in self._spent:
            self._spent.discard(self._serving)
            self._serving += 1
        self._turn.notify_all()
