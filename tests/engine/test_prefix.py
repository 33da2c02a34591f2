"""Prefix reuse: prompts that share a prefix with what a slot holds, or with each other, compute only the rest
and still give exactly the tokens of the full-sequence forward."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.prefix import ResidentPrefixes, shared_prefixes
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import (
    EOS,
    greedy_request,
    pairs_config,
    reference_greedy,
    run,
    spread_params,
    token_logprobs,
)


def _engine(tiny, spec="data=1,model=1", devices=1, **kw):
    config, params = tiny
    mesh = make_mesh(config, spec, jax.devices()[:devices])
    return Engine(config, params, mesh, eos_ids=[EOS], **kw)


def test_resident_prefixes_choose_the_longest_and_leave_one_token_to_compute():
    held = ResidentPrefixes(3)
    held.hold(0, list(range(10, 30)))
    held.hold(1, list(range(10, 50)))
    assert held.best(list(range(10, 40)) + [7]) == (1, 30)
    assert held.best(list(range(10, 30))) == (0, 19)  # the whole prompt is held: its last token is recomputed
    assert held.best([1, 2, 3] + list(range(10, 40))) == (None, 0)
    assert held.best(list(range(10, 40)), exclude=frozenset({1})) == (0, 20)
    held.truncate(12)
    assert held.best(list(range(10, 40))) == (0, 12)
    assert held.best(list(range(10, 15)) + [99]) == (None, 0)  # 5 tokens: below MIN_REUSE


def test_a_free_slot_holding_nearly_as_much_is_chosen_over_copying_from_a_busy_one():
    """A prompt that takes the free slot it reuses computes in place; one reusing a busy slot's prefix has it copied
    into another slot first. A free slot wins unless a busy one holds over FREE_SLACK tokens more."""
    held = ResidentPrefixes(4)
    system = list(range(10, 60))
    held.hold(0, system + [1, 2, 3, 4, 5, 6])  # busy, 4 tokens more in common with the prompt
    held.hold(2, system + [7])
    prompt = system + [1, 2, 3, 4, 9]
    assert held.best(prompt) == (0, 54)
    assert held.best(prompt, free=[2, 3]) == (2, 50)
    held.hold(1, system + list(range(200, 230)))
    long_prompt = system + list(range(200, 230)) + [5]
    assert held.best(long_prompt, free=[2, 3]) == (1, 80)  # 30 more tokens than the free slot's: copied
    assert held.best(long_prompt, free=[1]) == (1, 80)


def test_shared_prefixes_groups_prompts_by_their_common_start():
    system = list(range(3, 23))
    prompts = [system + [40, 41], system + [50], [9] * 30, system[:10] + [1] * 20, system + [40, 42, 43]]
    assert shared_prefixes(prompts) == [[([0, 1, 4], 20)]]
    assert shared_prefixes([system, system]) == [[([0, 1], 19)]]  # identical prompts: all but the last token


def test_shared_prefixes_nest_where_members_share_more():
    """A few-shot context (20 tokens), two questions on it (16 and 5 tokens), answers to each: the first question's
    answers share a prefix 16 tokens longer than the context, a group of its own; the second's only 5 more."""
    context, one, two = list(range(3, 23)), list(range(30, 46)), list(range(50, 55))
    prompts = [context + one + [7], context + two + [8], context + one + [9], [1] * 40, context + two + [9]]
    assert shared_prefixes(prompts) == [[([0, 1, 2, 4], 20)], [([0, 2], 36)]]


def test_prompts_admitted_together_share_their_prefix(tiny):
    config, params = tiny
    rng = np.random.default_rng(3)
    system = rng.integers(3, 131, 37).tolist()
    prompts = [system + rng.integers(3, 131, int(n)).tolist() for n in (1, 5, 9, 14, 30)]
    engine = _engine(tiny, max_slots=8)
    tokens, finals = run(engine, [greedy_request(i, p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert tokens[i] == reference_greedy(config, params, p, 12), i
        assert finals[i].cached_tokens == len(system)
    assert engine.stats.cached_tokens == len(system) * len(prompts)
    # the shared part was computed once: 37 tokens plus each prompt's own tail
    assert engine.stats.prefill_tokens == len(system) + sum(len(p) - len(system) for p in prompts)


@pytest.mark.slow
def test_a_later_turn_reuses_the_earlier_one_across_meshes(tiny):
    """The second turn's prompt is the first prompt, its answer, and more: all but the new part is reused,
    on a mesh whose model axis splits the KV heads and data axis splits the slots."""
    config, params = tiny
    rng = np.random.default_rng(4)
    first = rng.integers(3, 131, 25).tolist()
    for spec, devices in (("data=1,model=1", 1), ("data=2,model=2", 4)):
        engine = _engine(tiny, spec, devices, max_slots=4)
        turn_one = run(engine, [greedy_request("a", first, 20)])[0]["a"]
        assert turn_one == reference_greedy(config, params, first, 20)
        answer = turn_one if turn_one[-1] != EOS else turn_one[:-1]
        second = first + answer + rng.integers(3, 131, 6).tolist()
        other = rng.integers(3, 131, 30).tolist()  # shares nothing: computed in full alongside
        tokens, finals = run(engine, [greedy_request("b", second), greedy_request("c", other)])
        assert tokens["b"] == reference_greedy(config, params, second, 12), spec
        assert tokens["c"] == reference_greedy(config, params, other, 12), spec
        # the slot holds all but the last token of turn one (never fed back) unless that was the end token
        assert finals["b"].cached_tokens == len(first) + len(answer) - (answer == turn_one)
        assert finals["c"].cached_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["cpu-kernels", "xla-paged"])
def test_a_prefix_computed_alone_is_not_written_over_by_the_decode_steps_before_its_prompts_start(tiny, cache):
    """Two running requests decode while two prompts with a 100-token prefix arrive, with room in the step for the
    prefix alone: it is computed into a free slot, its prompts wait a step, and that step's decode must not run the
    slot (its device row, never started, would write position 0's keys and values over the prefix's)."""
    kw = dict(cpu_kernels=False, page_size=8) if cache == "xla-paged" else {}
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 131, 100).tolist()
    prompts = [prefix + rng.integers(3, 131, 20).tolist() for _ in range(2)]
    request = lambda i, p, n: Request(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    alone = [token_logprobs(_engine(tiny, max_slots=4, **kw), request(i, p, 5)) for i, p in enumerate(prompts)]
    engine = _engine(tiny, max_slots=4, step_tokens=106, **kw)
    for i in ("a", "b"):
        engine.add(request(i, rng.integers(3, 131, 10).tolist(), 100))
    engine.step()
    engine.step()
    got = {0: [], 1: []}
    for u in engine.generate([request(i, p, 5) for i, p in enumerate(prompts)]):
        got.get(u.id, []).extend(u.logprobs)
    assert engine.stats.cached_tokens >= 2 * 96  # the prefix was reused, not computed by each prompt
    for i in (0, 1):
        np.testing.assert_allclose(got[i], alone[i], rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_reuse_keeps_penalties_and_seeds_exact(tiny):
    """A prefix taken from the cache still counts as seen for the repetition penalty, and a seeded sample
    does not depend on whether the prefix was reused."""
    rng = np.random.default_rng(5)
    system = rng.integers(3, 131, 30).tolist()
    prompts = [system + rng.integers(3, 131, 4).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=11, repetition_penalty=1.5, presence_penalty=0.5)

    def outputs(requests_per_run):
        engine = _engine(tiny, max_slots=4)
        out = {}
        for batch in requests_per_run:
            out.update(run(engine, [Request(i, prompts[i], params) for i in batch])[0])
        return out, engine.stats.cached_tokens

    alone, cached_alone = outputs([[0], [1], [2]])  # each after the previous: reuses the held prefix
    fresh = {}
    for i in range(3):  # a new engine each: nothing to reuse
        fresh.update(outputs([[i]])[0])
    assert cached_alone == 2 * len(system)
    assert alone == fresh


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_gives_the_same_numbers_from_a_stored_prefix_as_computed_afresh(tiny, dtype):
    """With the cache in 16 bits (bfloat16's kept as its bits by the CPU kernels), a prompt computed from its start
    attends over the same rounded keys and values as one that starts from a slot's stored prefix: the same
    log-probabilities, to the bit, either way. bfloat16 at head dim 16, where the kernels compute attention as
    bfloat16 pairs on CPUs that have them (`library.attends_in_bfloat16`)."""
    if dtype == "bfloat16":
        config = pairs_config()
        tiny = config, spread_params(config)
    rng = np.random.default_rng(6)
    first = rng.integers(3, 131, 30).tolist()
    second = first + rng.integers(3, 131, 9).tolist()
    fresh = token_logprobs(_engine(tiny, max_slots=4, kv_cache_dtype=dtype), greedy_request("b", second))
    engine = _engine(tiny, max_slots=4, kv_cache_dtype=dtype)
    token_logprobs(engine, greedy_request("a", first, 4))
    assert engine.prefixes.best(second)[1] >= 20  # the second prompt starts from the first's slot
    assert token_logprobs(engine, greedy_request("b", second)) == fresh
