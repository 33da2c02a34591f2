"""The scheduler alone, over a scripted device (no model, no jax): admission, finish reasons as the device reports
them, `finish` with a reason, and that the module never imports jax."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from jaxllama.engine import buckets
from jaxllama.engine.interface import LENGTH, RUNNING, STOPPED, Sampled
from jaxllama.engine.request import Request, SamplingParams
from jaxllama.engine.scheduler import Scheduler
from tests.helpers.engine import run

EOS = 99


class ScriptedRunner:
    """Each slot counts up from its prompt's last token; a row stops at EOS (STOPPED), or LENGTH when its
    max_tokens are spent. Records every call."""

    slots, max_context, decode_steps, vocab_size = 3, 64, 1, 100
    eos_ids, max_stop_ids, row_multiple, reuse_multiple, packs_prompts, joins_decode = (EOS,), 32, 1, 1, False, False
    pages = None
    chunk_multiple = 1

    def __init__(self):
        self.rows: dict[int, list[int]] = {}  # slot -> [next token, tokens left]
        self.calls: list[tuple] = []

    def make_room(self, needed, lengths):
        return self.max_context

    def prefill(self, rows, sample=True):
        self.calls.append(("prefill", [r.slot for r in rows], sample))
        if not sample:
            return None
        for r in rows:
            self.rows[r.slot] = [r.request.prompt[-1] + 1, r.request.params.max_tokens]
        return self._emit([r.slot for r in rows])

    def generate(self, columns, params, cancelled=()):
        self.calls.append(("generate", list(columns), list(cancelled)))
        for slot in cancelled:
            self.rows.pop(slot, None)
        return self._emit(columns)

    def _emit(self, columns):
        n = len(columns)
        tokens, emitted, finish = np.zeros((1, n), int), np.zeros((1, n), bool), np.full((1, n), RUNNING)
        for i, slot in enumerate(columns):
            if slot not in self.rows:
                continue
            row = self.rows[slot]
            tokens[0, i], emitted[0, i] = row[0], True
            row[0], row[1] = row[0] + 1, row[1] - 1
            if tokens[0, i] == EOS or row[1] == 0:
                finish[0, i] = STOPPED if tokens[0, i] == EOS else LENGTH
                del self.rows[slot]
        return Sampled(tokens, np.zeros((1, n), np.float32), emitted, finish)


def test_finish_reasons_are_the_devices():
    scheduler = Scheduler(ScriptedRunner())
    tokens, finals = run(
        scheduler,
        [Request("eos", [95], SamplingParams(max_tokens=10)), Request("len", [10], SamplingParams(max_tokens=3))],
    )
    assert tokens == {"eos": [96, 97, 98, 99], "len": [11, 12, 13]}
    assert (finals["eos"].finish_reason, finals["eos"].stop_reason) == ("stop", EOS)
    assert (finals["len"].finish_reason, finals["len"].stop_reason) == ("length", None)
    assert finals["len"].prompt_tokens == 1 and finals["len"].completion_tokens == 3


def test_more_requests_than_slots_wait_and_take_freed_slots_by_priority():
    device = ScriptedRunner()
    scheduler = Scheduler(device)
    requests = [Request(i, [10 * i], SamplingParams(max_tokens=2 + i), priority=i) for i in range(5)]
    tokens, finals = run(scheduler, requests)
    assert set(finals) == set(range(5)) and all(len(tokens[i]) == 2 + i for i in range(5))
    first = device.calls[0]
    assert first[0] == "prefill" and len(first[1]) == 3  # three slots: the three of highest priority first
    assert scheduler.stats.generated_tokens == sum(2 + i for i in range(5)) - 5  # decoded: all but the first tokens


def test_prompts_of_any_lengths_are_packed_into_calls_of_at_most_packed_tokens(monkeypatch):
    """A runner that packs prompts gets those admitted together in one call, whatever their lengths, up to
    PACKED_TOKENS tokens a call (a longer prompt alone); one that does not, a call per prompt bucket."""
    monkeypatch.setattr(buckets, "PACKED_TOKENS", 40)
    lengths = [3, 30, 20, 50, 5]  # buckets 16, 32, 32, 64, 16
    for packs, calls in ((True, [[0, 1], [2], [3], [4]]), (False, [[0, 1], [2, 3], [4]])):
        device = ScriptedRunner()
        device.slots, device.packs_prompts = 5, packs
        prompts = [[i + 1] * n for i, n in enumerate(lengths)]  # no two share a prefix
        run(Scheduler(device), [Request(i, p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)])
        assert [slots for kind, slots, _ in device.calls if kind == "prefill"] == calls


def test_finish_ends_a_running_request_with_its_reason_and_stops_its_slot():
    device = ScriptedRunner()
    scheduler = Scheduler(device)
    scheduler.add(Request("a", [1], SamplingParams(max_tokens=50)))
    scheduler.add(Request("b", [50], SamplingParams(max_tokens=50)))
    scheduler.step()
    scheduler.finish("a", "stop", "END")
    updates = scheduler.step()
    final = [u for u in updates if u.id == "a"]
    assert len(final) == 1 and (final[0].finish_reason, final[0].stop_reason) == ("stop", "END")
    slot_a = 0
    assert device.calls[-1][0] == "generate" and device.calls[-1][2] == [slot_a]  # told to stop it
    assert scheduler.running == 1


def test_finish_drops_a_waiting_request_at_once():
    scheduler = Scheduler(ScriptedRunner())
    for i in range(4):
        scheduler.add(Request(i, [1], SamplingParams(max_tokens=5)))
    scheduler.step()
    assert scheduler.is_waiting(3)
    scheduler.finish(3, "cancelled")
    assert not scheduler.is_waiting(3)
    assert 3 not in run(scheduler, [])[1]


def test_the_scheduler_imports_no_jax():
    code = "import sys, jaxllama.engine.scheduler; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
