"""Log-probabilities from the engine against the full forward pass's log-softmax (the tiny float32 model): each
prompt token's given the tokens before it, with their top alternatives, whatever shares the batch and whether a
prefix was reused; the generated tokens' top alternatives from the distribution they were sampled from; and
max_tokens 0, which ends a request after its prompt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core.model import sequence_logits
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import MAX_LOGPROBS, Request, SamplingParams
from tests.helpers.engine import run

_forward = jax.jit(sequence_logits, static_argnums=1)


def log_softmax(config, params, tokens) -> np.ndarray:
    """[t, vocab] log-softmax of the whole sequence's logits at each position."""
    logits = np.asarray(_forward(params, config, jnp.asarray([tokens])), np.float64)[0]
    return (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )


@pytest.fixture(scope="module")
def engine(tiny):
    config, params = tiny
    # A float32 cache, as the forward pass keeps (the CPU kernels' own default is float16)
    mesh = make_mesh(config, "data=1,model=1")
    return Engine(config, params, mesh, eos_ids=[2], max_slots=8, kv_cache_dtype="float32")


def scoring_prompts(seed=0):
    """Continuations of one 30-token context, and two unrelated prompts."""
    rng = np.random.default_rng(seed)
    context = rng.integers(3, 131, 30).tolist()
    prompts = [context + rng.integers(3, 131, n).tolist() for n in (1, 4, 9)]
    return prompts + [rng.integers(3, 131, n).tolist() for n in (2, 17)]


def prompt_logprobs(engine, prompts, top=5, max_tokens=0):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=top)
    requests = [Request(i, p, params) for i, p in enumerate(prompts)]
    out = {}
    for u in engine.generate(requests):
        if u.prompt_logprobs is not None:
            out[u.id] = u.prompt_logprobs
    return [out[i] for i in range(len(prompts))], requests


@pytest.mark.slow
def test_prompt_logprobs_equal_the_forward_pass(engine, tiny):
    config, params = tiny
    prompts = scoring_prompts()
    got, _ = prompt_logprobs(engine, prompts, top=5)
    # More continuations of the context, one at a time: each starts from a slot that holds another one.
    cached = engine.stats.cached_tokens
    for extra in scoring_prompts(seed=3)[:3]:
        prompts.append(prompts[0][:30] + extra[30:])
        got += prompt_logprobs(engine, prompts[-1:], top=5)[0]
    assert engine.stats.cached_tokens - cached >= 3 * 29
    for prompt, positions in zip(prompts, got, strict=True):
        ref = log_softmax(config, params, prompt)
        assert len(positions) == len(prompt) - 1
        for j, (lp, top) in enumerate(positions):
            assert lp == pytest.approx(ref[j, prompt[j + 1]], abs=1e-5)
            order = np.argsort(-ref[j], kind="stable")[:5]
            assert [t for t, _ in top] == order.tolist()
            assert [v for _, v in top] == pytest.approx(ref[j, order], abs=1e-5)


def test_prompt_logprobs_do_not_depend_on_the_batch_or_prefix_reuse(engine):
    prompts = scoring_prompts(seed=1)
    together, _ = prompt_logprobs(engine, prompts)
    assert engine.stats.cached_tokens > 0  # the shared context was computed once and reused
    alone = [prompt_logprobs(engine, [p])[0][0] for p in reversed(prompts)][::-1]
    reused, _ = prompt_logprobs(engine, prompts[:3][::-1])  # now from the slots that hold the context
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], atol=1e-6)
        assert [[t for t, _ in top] for _, top in a] == [[t for t, _ in top] for _, top in b]
    for a, b in zip(together[:3], reused[::-1], strict=True):
        np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], atol=1e-6)


def test_max_tokens_zero_ends_after_the_prompt(engine):
    _, requests = prompt_logprobs(engine, scoring_prompts()[3:], top=0)
    tokens, finals = run(engine, requests)
    assert all(tokens[r.id] == [] for r in requests)
    assert all(finals[r.id].finish_reason == "length" and finals[r.id].completion_tokens == 0 for r in requests)
    assert all(len(finals[r.id].prompt_logprobs or []) in (0, len(r.prompt) - 1) for r in requests)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_top_logprobs_are_the_sampling_distributions_top(engine, tiny, temperature):
    config, params = tiny
    prompts = scoring_prompts(seed=2)[3:]
    sampling = SamplingParams(max_tokens=6, temperature=temperature, seed=3, top_logprobs=MAX_LOGPROBS)
    updates = list(engine.generate([Request(i, p, sampling) for i, p in enumerate(prompts)]))
    for i, prompt in enumerate(prompts):
        mine = [u for u in updates if u.id == i]
        tokens = [t for u in mine for t in u.tokens]
        logprobs = [x for u in mine for x in u.logprobs]
        tops = [x for u in mine for x in u.top_logprobs]
        logits = log_softmax(config, params, prompt + tokens)[len(prompt) - 1 :]
        scaled = logits / (temperature or 1.0)
        scaled -= np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) + scaled.max(
            -1, keepdims=True
        )
        assert len(tops) == len(tokens) > 0
        for j, (token, lp, top) in enumerate(zip(tokens, logprobs, tops, strict=True)):
            order = np.argsort(-scaled[j], kind="stable")[:MAX_LOGPROBS]
            assert [t for t, _ in top] == order.tolist()
            assert [v for _, v in top] == pytest.approx(scaled[j, order], abs=1e-5)
            assert lp == pytest.approx(scaled[j, token], abs=1e-5)  # the token's own, from the same distribution
