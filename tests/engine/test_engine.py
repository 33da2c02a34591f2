"""The engine against the plain forward pass: greedy tokens equal re-running the whole sequence each token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.core.model import sequence_logits
from jaxllama.core.sharding import make_mesh
from jaxllama.engine.engine import Engine
from jaxllama.engine.request import Request, SamplingParams
from tests.helpers.engine import EOS, forward, greedy_requests, random_prompts, reference_greedy, run


@pytest.fixture(scope="module")
def expected(tiny):
    config, params = tiny
    return {r.id: reference_greedy(config, params, r.prompt, r.params.max_tokens) for r in greedy_requests()}


@pytest.mark.slow
def test_greedy_matches_full_forward_with_refilled_slots(tiny, expected):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    # 10 requests through 4 slots; the 3 layers run as two programs (2 layers, then 1)
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=4, layers_per_program=2)
    tokens, finals = run(engine, greedy_requests())
    assert tokens == expected
    for r in greedy_requests():
        u = finals[r.id]
        assert u.completion_tokens == len(expected[r.id]) and u.prompt_tokens == len(r.prompt)
        if expected[r.id][-1] == EOS:
            assert (u.finish_reason, u.stop_reason) == ("stop", EOS)
        else:
            assert u.finish_reason == "length" and len(expected[r.id]) == r.params.max_tokens
    assert engine.stats.prefill_calls >= 3 and engine.stats.occupancy(engine.slots) > 0.3


def test_higher_priority_requests_get_slots_first(tiny, expected):
    """One slot: requests run one at a time, the highest priority first, in order of arrival among equals; their
    tokens are unchanged."""
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=1)
    priorities = [0, 5, 1, 5, 0]
    requests = [dataclasses.replace(r, priority=p) for r, p in zip(greedy_requests()[:5], priorities, strict=True)]
    started, tokens = [], {}
    for u in engine.generate(requests):
        if u.id not in tokens:
            started.append(u.id)
        tokens.setdefault(u.id, []).extend(u.tokens)
    assert started == [1, 3, 2, 0, 4]
    assert tokens == {i: expected[i] for i in range(5)}


@pytest.mark.slow
@pytest.mark.parametrize("spec, steps, layers", [("data=1,model=1", 1, 5), ("data=2,model=2", 3, 1)])
def test_few_active_slots_decode_alone(tiny, expected, spec, steps, layers):
    """10 requests in 32 slots: decode steps run only the active slots (16, then 8 rows, or one when one is
    left), reading and writing their rows of the shared cache in place; the tokens stay those of the full
    forward, with the layers run as one program or one program per layer."""
    config, params = tiny
    mesh = make_mesh(config, spec, jax.devices()[: 4 if "2" in spec else 1])
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=32, decode_steps=steps, layers_per_program=layers)
    sizes = []
    decode_rows = engine._decode_columns
    engine._decode_columns = lambda: sizes.append(len(rows := decode_rows())) or rows
    tokens, _ = run(engine, greedy_requests())
    assert tokens == expected
    data = mesh.shape["data"]
    assert sizes[0] == 16 and 8 in sizes and set(sizes) <= {data, 8, 16}

    sizes.clear()  # one request alone: one row (two on a data axis of 2)
    alone = greedy_requests()[3]
    assert run(engine, [alone])[0][alone.id] == expected[alone.id]
    assert set(sizes) == {data}


# Each mesh compiles its own programs. A model axis of 2 splits the 2 KV heads; one of 4 replicates them and splits
# the query heads, here with a data axis and several decode steps a call; data=2,model=2 runs in
# test_few_active_slots_decode_alone, across processes in test_multihost.
@pytest.mark.slow
@pytest.mark.parametrize("spec, steps", [("data=1,model=2", 1), ("data=2,model=4", 3)])
def test_same_tokens_on_every_mesh(tiny, expected, spec, steps):
    """2 KV heads on a model axis of 4: KV heads replicated, query heads split."""
    from jaxllama.core.params import param_shardings

    config, params = tiny
    d, m = (int(part.split("=")[1]) for part in spec.split(","))
    mesh = make_mesh(config, spec, jax.devices()[: d * m])
    sharded = jax.device_put(params, param_shardings(config, mesh))
    engine = Engine(config, sharded, mesh, eos_ids=[EOS], max_slots=4, decode_steps=steps)
    requests = greedy_requests()[:5]
    tokens, _ = run(engine, requests)
    assert tokens == {r.id: expected[r.id] for r in requests}


@pytest.mark.slow
def test_context_limit_ends_with_length(tiny):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, params, mesh, eos_ids=[], max_slots=2, max_context=48)
    prompt = random_prompts(1, seed=5, max_len=40)[0][:40]
    tokens, finals = run(engine, [Request("r", prompt, SamplingParams(max_tokens=100, temperature=0.0))])
    assert finals["r"].finish_reason == "length"
    assert len(prompt) + len(tokens["r"]) == 48
    assert tokens["r"] == reference_greedy(config, params, prompt, 100, eos=(), limit=48)


def test_extra_stop_token_ids(tiny, expected):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    r = next(r for r in greedy_requests() if len(expected[r.id]) >= 4 and EOS not in expected[r.id])
    stop = expected[r.id][2]
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=2)
    req = Request(
        "x", r.prompt, SamplingParams(max_tokens=r.params.max_tokens, temperature=0.0, stop_token_ids=(stop,))
    )
    tokens, finals = run(engine, [req])
    first = expected[r.id].index(stop)
    assert tokens["x"] == expected[r.id][: first + 1]
    assert (finals["x"].finish_reason, finals["x"].stop_reason) == ("stop", stop)


BAD = [
    (dict(prompt=list(range(3, 200))), "context limit is 128"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[5, 131]), "outside the vocabulary"),
    (dict(params=dict(max_tokens=-1)), "max_tokens=-1"),
    (dict(params=dict(temperature=-1.0)), "temperature=-1.0"),
    (dict(params=dict(top_p=0.0)), "top_p=0.0"),
    (dict(params=dict(top_p=1.5)), "top_p=1.5"),
    (dict(params=dict(stop_token_ids=(10**12,))), "1000000000000 is outside the vocabulary"),
]


@pytest.mark.slow
def test_bad_requests_are_refused_alone(tiny, expected):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=4)
    good = greedy_requests()[:3]
    for r in good[:2]:
        engine.add(r)
    for bad, message in BAD:
        with pytest.raises(ValueError, match=message):
            if "params" in bad:
                engine.add(Request("bad", [5, 6], SamplingParams(**bad["params"])))
            else:
                engine.add(Request("bad", bad["prompt"], SamplingParams(max_tokens=4)))
    engine.add(good[2])
    # past the context or the vocabulary (and int32): the limit
    huge = SamplingParams(max_tokens=10**12, top_k=10**12, temperature=0.0)
    engine.add(Request("huge", good[0].prompt, huge))
    tokens, finals = run(engine, [])
    assert {k: v for k, v in tokens.items() if k != "huge"} == {r.id: expected[r.id] for r in good}
    assert tokens["huge"][: len(expected[good[0].id])] == expected[good[0].id]
    assert finals["huge"].finish_reason in ("stop", "length")


def test_cancel_frees_the_slot(tiny, expected):
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, params, mesh, eos_ids=[EOS], max_slots=1)
    long = Request("long", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0))
    rest = greedy_requests()[:2]
    for r in [long, *rest]:
        engine.add(r)
    engine.step()
    engine.finish("long", "cancelled")
    tokens, finals = run(engine, [])
    assert finals["long"].finish_reason == "cancelled"
    assert {r.id: tokens[r.id] for r in rest} == {r.id: expected[r.id] for r in rest}


@pytest.mark.slow
def test_donated_weights_are_replaced_by_the_prepared_ones(tiny, expected):
    """With `donate_params`, the engine keeps one copy of the model: the weights its backend prepared (on the CPU
    kernels, packed: the products' float32 arrays are freed), and `engine.params` runs the plain forward pass with
    `engine.ops` to the same tokens."""
    config, params = tiny
    mine = jax.tree.map(jnp.copy, params)  # the fixture's own arrays stay alive for the other tests
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    engine = Engine(config, mine, mesh, eos_ids=[EOS], max_slots=4, donate_params=True)
    assert run(engine, greedy_requests())[0] == expected
    leaves = jax.tree.leaves(mine)
    replaced = [x for x in leaves if x.is_deleted()]
    if engine.ops.prepare(params, config) is params:  # XLA's ops read the weights as they are: nothing replaced
        assert not replaced
    else:
        assert len(replaced) == 7 * config.n_layers + (0 if config.tie_embeddings else 1)  # every product's weight
        assert not mine["layers_0"]["attention_norm"]["scale"].is_deleted()  # kept as it is: not a product
        tokens = jnp.asarray([greedy_requests()[0].prompt])
        prepared = sequence_logits(engine.params, config, tokens, engine.ops)
        np.testing.assert_allclose(prepared, forward(params, config, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_ignore_eos_and_min_tokens(tiny):
    """ignore_eos: the model's end-of-generation id does not end a request; min_tokens: no stop id is sampled before
    that many tokens. Each request's tokens are the same alone and in a batch with the others."""
    config, params = tiny
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    prompt = random_prompts(1, seed=7)[0]
    free = run(Engine(config, params, mesh, eos_ids=[], max_slots=4), [Request("f", prompt, greedy(12))])[0]["f"]
    eos = free[2]  # the model's third token, made its end-of-generation id
    first = free.index(eos)
    requests = [
        Request("plain", prompt, greedy(12)),
        Request("ignore", prompt, greedy(12, ignore_eos=True)),
        Request("min", prompt, greedy(12, min_tokens=first + 2)),
        Request("stop", prompt, greedy(12, ignore_eos=True, stop_token_ids=(eos,))),
    ]
    engine = Engine(config, params, mesh, eos_ids=[eos], max_slots=4)
    together_tokens, finals = run(engine, requests)
    assert together_tokens["plain"] == free[: first + 1] and finals["plain"].finish_reason == "stop"
    assert together_tokens["ignore"] == free and finals["ignore"].finish_reason == "length"
    assert together_tokens["stop"] == free[: first + 1] and finals["stop"].stop_reason == eos  # stop ids still stop
    held = together_tokens["min"]
    assert eos not in held[: first + 2] and len(held) > first + 2 - 1
    assert held[:first] == free[:first] and held[first] != eos  # held back exactly where it would have ended
    for r in requests:
        assert run(Engine(config, params, mesh, eos_ids=[eos], max_slots=4), [r])[0][r.id] == together_tokens[r.id]


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("int8", [False, True])
def test_an_accelerators_operations_give_the_same_tokens_on_a_cpu_mesh(tiny, expected, int8):
    """A GPU's operations (as a TPU's, less their kernels, which heads this narrow do not take): wq and wk reordered
    for rotary halves, a paged cache, the feed-forward's gate behind a barrier, and with int8 weights their row-parallel
    products scaled after the split by token, here over a model axis of 2. The tokens are the float reference's, and
    with int8 weights those of XLA's int8 products on one device."""
    from jaxllama.backends.pallas import GpuOps
    from jaxllama.core.ops import Ops
    from jaxllama.core.params import param_shardings

    config, params = tiny
    requests = greedy_requests()[:6]
    want = {r.id: expected[r.id] for r in requests}
    if int8:
        one = make_mesh(config, "data=1,model=1", jax.devices()[:1])
        engine = Engine(
            config, params, one, eos_ids=[EOS], max_slots=4, ops=Ops(float32_products=True, int8_weights=True)
        )
        want = run(engine, requests)[0]
    mesh = make_mesh(config, "data=1,model=2", jax.devices()[:2])
    ops = GpuOps(interpret=True, int8_weights=int8)
    engine = Engine(
        config, jax.device_put(params, param_shardings(config, mesh)), mesh, eos_ids=[EOS], max_slots=4, ops=ops
    )
    assert engine.runner.pages is not None  # a paged cache, as an accelerator's
    assert run(engine, requests)[0] == want
