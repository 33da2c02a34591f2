"""A prefill through the CPU kernels runs as one packed batch of its prompts' tokens over the slots' cache
(`LayerCalls.packed`): the same tokens, log-probabilities and prompt log-probabilities as prompts computed
as padded rows over copies of their slots' rows, whatever the prompts share (a reused prefix, a step, a call), and
the reference's tokens; and a decode step joined to a packed prefill call gives what it gives alone."""

import shutil

import jax
import numpy as np
import pytest

from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import random_prompts, reference_greedy, run, spread_params, tiny_config

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")


def _requests(seed: int) -> list[Request]:
    """Prompts of many lengths, some of them sharing a prefix (a system prompt), with the top log-probabilities."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 131, size=37).tolist()
    prompts = random_prompts(6, seed) + [shared + p for p in random_prompts(6, seed + 1, max_len=20)]
    params = lambda i: SamplingParams(
        max_tokens=4 + i % 5, temperature=0.0, top_logprobs=2, prompt_logprobs=2 if i % 3 == 0 else None
    )
    return [Request(i, p, params(i)) for i, p in enumerate(prompts)]


def _prompt_logprobs(engine, request) -> list:
    """The prompt's log-probabilities and top alternatives, the engine run on it alone."""
    first = next(iter(engine.generate([request])))
    return first.prompt_logprobs


def _engine_args(config, params) -> tuple:
    return config, params, make_mesh(config, "data=1,model=1", jax.devices()[:1])


def _engine(config, params, slots: int) -> Engine:
    return Engine(*_engine_args(config, params), eos_ids=[], max_slots=slots)


# prompts admitted a few at a time, or all in one packed call
@pytest.mark.parametrize("slots", [pytest.param(4, marks=pytest.mark.slow), 16])
def test_packed_prefill_matches_prompts_as_rows(cpu_kernels, monkeypatch, slots):
    assert cpu_kernels
    config = tiny_config()
    params = spread_params(config, seed=7)
    got = {}
    for packed in (True, False):
        monkeypatch.setattr(CpuOps, "packed_prefill", packed)
        engine = _engine(config, params, slots)
        assert isinstance(engine.ops, CpuOps)
        tokens, finals = run(engine, _requests(3))
        kinds = {key[0] for key in engine.runner.programs._compiled}
        assert ("prefill_packed" in kinds) is packed and ("prefill_copy" in kinds) is packed
        # a few slots: prompts admitted while others decode, the decode step joined to their prefill call
        assert ("mixed_inputs" in kinds) is (packed and slots == 4)
        logprobs = {i: [lp for u in engine.generate([r]) for lp in u.logprobs] for i, r in enumerate(_requests(3)[:3])}
        prompts = {i: _prompt_logprobs(engine, r) for i, r in enumerate(_requests(3)) if r.params.prompt_logprobs}
        got[packed] = tokens, logprobs, {i: u.cached_tokens for i, u in finals.items()}, prompts
    assert got[True] == got[False]
    assert sum(got[True][2].values()) > 0  # the shared prefix was reused
    for r in _requests(3):
        assert got[True][0][r.id] == reference_greedy(config, params, r.prompt, r.params.max_tokens)


@pytest.mark.slow
def test_nested_shared_prefixes_are_computed_once_and_score_as_alone(cpu_kernels):
    """Scoring: 2 contexts, 2 questions on each, 3 answers to each question, all admitted at once. Each context and
    each question is computed once (a level at a time, copied one slot after another), and every prompt's
    log-probabilities are those of the prompt computed alone on a fresh engine."""
    assert cpu_kernels
    config = tiny_config()
    params = spread_params(config, seed=7)
    rng = np.random.default_rng(11)
    tail = lambda n: rng.integers(3, 131, size=n).tolist()
    prompts = [c + q + tail(2) for c in (tail(40), tail(40)) for q in (tail(20), tail(20)) for _ in range(3)]
    scoring = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1)
    requests = [Request(i, p, scoring) for i, p in enumerate(prompts)]
    engine = _engine(config, params, 16)
    together = {u.id: u.prompt_logprobs for u in engine.generate(requests) if u.prompt_logprobs is not None}
    # 2 x 40 + 4 x 20 + 12 x 2 distinct tokens; each reuse recomputes its prefix's last token (its log-probability)
    assert engine.stats.prefill_tokens <= 2 * 40 + 4 * 20 + 12 * 2 + 16
    for r in requests:
        assert together[r.id] == _prompt_logprobs(_engine(config, params, 16), r), r.id


@pytest.mark.slow
def test_a_prompt_admitted_while_others_decode_is_computed_in_chunks_as_it_is_alone(cpu_kernels):
    """Prompts that arrive while slots decode are computed at most `step_tokens` tokens a step, each step's chunk
    in one call with the decode step; a prompt that waits meanwhile, a chunk that reuses a prefix, and each
    request's tokens, log-probabilities and prompt log-probabilities are what the request gives alone."""
    assert cpu_kernels
    config = tiny_config(max_seq_len=512)
    params = spread_params(config, seed=7)
    rng = np.random.default_rng(5)
    first = rng.integers(3, 131, size=300).tolist()
    greedy = lambda n, **kw: SamplingParams(max_tokens=n, temperature=0.0, top_logprobs=2, **kw)
    running = [Request(f"run{i}", p, greedy(60)) for i, p in enumerate(random_prompts(2, 9))]
    arriving = [
        Request("long", first, greedy(5, prompt_logprobs=2)),
        Request("reuses", first[:150] + rng.integers(3, 131, size=90).tolist(), greedy(5)),
        Request("waits", rng.integers(3, 131, size=70).tolist(), greedy(5, prompt_logprobs=1)),
    ]
    engine = Engine(*_engine_args(config, params), eos_ids=[], max_slots=6, step_tokens=64)
    for r in running:
        engine.add(r)
    updates = engine.step()
    calls = engine.stats.prefill_calls
    for r in arriving:
        engine.add(r)
    while engine.has_work():
        updates += engine.step()
    assert engine.stats.prefill_calls - calls >= (300 + 90 + 70) // 64  # a call a step, no more than 64 tokens each
    assert "mixed_inputs" in {key[0] for key in engine.runner.programs._compiled}
    alone = _engine(config, params, 6)
    for r in running + arriving:
        mine = [u for u in updates if u.id == r.id]
        theirs = list(alone.generate([r]))
        assert [t for u in mine for t in u.tokens] == [t for u in theirs for t in u.tokens], r.id
        assert [lp for u in mine for lp in u.logprobs] == [lp for u in theirs for lp in u.logprobs], r.id
        assert mine[0].prompt_logprobs == theirs[0].prompt_logprobs, r.id
        if r.params.prompt_logprobs:
            assert len(mine[0].prompt_logprobs) == len(r.prompt) - 1
    tokens = {r.id: [t for u in updates if u.id == r.id for t in u.tokens] for r in arriving}
    for r in arriving:
        assert tokens[r.id] == reference_greedy(config, params, r.prompt, r.params.max_tokens)


def test_a_prompt_cancelled_between_its_chunks_ends_with_no_update_and_frees_its_slot(cpu_kernels):
    """A request whose prompt is computed in part still counts as waiting: cancelled, it is dropped at once (no
    update, as a queued one), and its slot takes the next request."""
    assert cpu_kernels
    config = tiny_config(max_seq_len=512)
    params = spread_params(config, seed=7)
    engine = Engine(*_engine_args(config, params), eos_ids=[], max_slots=2, step_tokens=64)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)
    engine.add(Request("runs", random_prompts(1, 3)[0], greedy(30)))
    updates = engine.step()
    long = Request("long", np.random.default_rng(1).integers(3, 131, size=300).tolist(), greedy(4))
    engine.add(long)
    updates += engine.step()
    assert engine.is_waiting("long") and engine.running == 2  # its first chunk computed, its slot held
    engine.finish("long")
    assert not engine.is_waiting("long") and engine.running == 1
    after = Request("after", random_prompts(1, 4)[0], greedy(3))
    engine.add(after)
    while engine.has_work():
        updates += engine.step()
    assert not [u for u in updates if u.id == "long"]
    assert [u.finish_reason for u in updates if u.id == "after" and u.finish_reason] == ["length"]


class _EvenTokens:
    """A constraint (`request.TokenConstraint`) that allows only even token ids below `top`, and remembers what it was
    given: what the model draws under it differs from what it draws free."""

    def __init__(self, top: int = 60):
        self.top, self.accepted = top, []

    def fill_mask(self, out: np.ndarray) -> None:
        bits = np.zeros(out.shape, np.uint32)
        for t in range(0, self.top, 2):
            bits[t // 32] |= np.uint32(1 << (t % 32))
        out[:] = bits.view(np.int32)

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    done, error = False, None


@pytest.mark.slow
def test_a_decode_step_joins_a_prefill_call_while_rows_draw_under_constraints(cpu_kernels):
    """Constrained rows, running and arriving, no longer keep the decode step out of the prefill call: each row's
    mask goes into the joined call, and every request's tokens and log-probabilities are what it gives alone."""
    assert cpu_kernels
    config = tiny_config()
    params = spread_params(config, seed=7)
    prompts = random_prompts(4, 11)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, top_logprobs=2)

    def requests():
        constrained = {"even", "even-late"}
        names = ("free", "even", "even-late", "free-late")
        constraint = lambda name: _EvenTokens() if name in constrained else None
        return [Request(n, p, greedy, constraint=constraint(n)) for n, p in zip(names, prompts, strict=True)]

    engine = _engine(config, params, 4)
    running, arriving = requests()[:2], requests()[2:]
    for r in running:
        engine.add(r)
    updates = engine.step()
    for r in arriving:
        engine.add(r)
    while engine.has_work():
        updates += engine.step()
    assert "mixed_inputs" in {key[0] for key in engine.runner.programs._compiled}
    alone = _engine(config, params, 4)
    for r, again in zip(running + arriving, requests(), strict=True):
        mine = [u for u in updates if u.id == r.id]
        theirs = list(alone.generate([again]))
        tokens = [t for u in mine for t in u.tokens]
        assert tokens == [t for u in theirs for t in u.tokens], r.id
        assert [lp for u in mine for lp in u.logprobs] == [lp for u in theirs for lp in u.logprobs], r.id
        if r.constraint is not None:
            assert tokens and all(t % 2 == 0 and t < 60 for t in tokens)
            assert r.constraint.accepted == tokens[:-1]  # told each token drawn but the last, which ends it
    free = [t for u in updates if u.id == "free" for t in u.tokens]
    assert any(t % 2 or t >= 60 for t in free)  # the constraint changes what is drawn


@pytest.mark.slow
def test_a_shared_prefix_admitted_while_slots_decode_is_computed_within_the_step_budget(cpu_kernels):
    """Prompts that share a prefix no slot holds, arriving while slots decode: no step computes more prompt tokens
    than its budget (`step_tokens` less its decode rows), the shared prefix included, and each request's tokens are
    what it gives alone."""
    assert cpu_kernels
    config = tiny_config(max_seq_len=512)
    params = spread_params(config, seed=7)
    rng = np.random.default_rng(6)
    shared = rng.integers(3, 131, size=100).tolist()
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)
    running = [Request(f"run{i}", p, greedy(40)) for i, p in enumerate(random_prompts(2, 9))]
    arriving = [Request(f"shares{i}", shared + rng.integers(3, 131, size=8).tolist(), greedy(4)) for i in range(3)]
    engine = Engine(*_engine_args(config, params), eos_ids=[], max_slots=6, step_tokens=64)
    steps: list[list[int]] = []  # per step, the tokens each call computed: prompt rows, and decode rows if joined

    def recording(call, joined: bool):
        def record(rows, *args, **kwargs):
            decoding = sum(1 for slot in args[0] if slot < 6) if joined else 0  # columns past the slots: padding
            steps[-1].append(sum(len(r.tokens) for r in rows) + decoding)
            return call(rows, *args, **kwargs)

        return record

    engine.runner.prefill = recording(engine.runner.prefill, False)
    engine.runner.prefill_and_decode = recording(engine.runner.prefill_and_decode, True)
    for r in running:
        engine.add(r)
    steps.append([])
    updates = engine.step()
    for r in arriving:
        engine.add(r)
    while engine.has_work():
        steps.append([])
        updates += engine.step()
    assert all(sum(calls) <= 64 for calls in steps[1:]), steps
    assert sum(map(sum, steps[1:])) < 100 * 3  # the shared prefix computed once, not by each prompt
    alone = _engine(config, params, 6)
    for r in running + arriving:
        mine = [t for u in updates if u.id == r.id for t in u.tokens]
        assert mine == [t for u in alone.generate([r]) for t in u.tokens], r.id
