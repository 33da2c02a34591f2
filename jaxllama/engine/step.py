"""The engine's jitted core, pure functions over a `DecodeState` pytree (donated and returned):

- `prefill`: run new prompts, sample their first tokens and insert them into free decode slots;
- `decode`: advance every slot by `n_steps` tokens, checking end of generation on device.

Shapes are static per call: prompts padded to a length bucket and a row-count bucket, the cache to a
length bucket (`kvcache.py`), so the number of compilations stays small and bounded.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache, empty_cache, forward
from jaxllama.engine.sampling import SamplerFlags, SamplingRows, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the decode loop carries, per slot; [s] = [slots]."""

    cache: KVCache
    tokens: jax.Array  # [s] int32: the next input token (last one sampled)
    positions: jax.Array  # [s] int32: its position
    active: jax.Array  # [s] bool: still generating
    remaining: jax.Array  # [s] int32: tokens it may still sample
    limit: jax.Array  # [s] int32: context limit (prompt + generated tokens)
    step: jax.Array  # [s] int32: tokens sampled so far (folds into the random key)
    stop_ids: jax.Array  # [s, e] int32: end-of-generation ids, padded with -1
    rows: SamplingRows  # [s] sampling parameters
    counts: jax.Array  # [s, vocab] int32: generated-token counts (penalties)
    seen: jax.Array  # [s, vocab] bool: prompt or generated tokens (repetition penalty)


def _advance(state: DecodeState, tokens, logprobs, was_active):
    """Record sampled tokens [s] for the rows that were active; decide which rows are done."""
    tokens = jnp.where(was_active, tokens, state.tokens)
    hit_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
    remaining = state.remaining - was_active
    positions = jnp.where(was_active, state.positions + 1, state.positions)
    done = hit_stop | (remaining <= 0) | (positions + 1 >= state.limit)
    rows = jnp.arange(tokens.shape[0])
    return dataclasses.replace(
        state,
        tokens=tokens,
        positions=positions,
        remaining=remaining,
        active=was_active & ~done,
        step=state.step + was_active,
        counts=state.counts.at[rows, tokens].add(was_active.astype(jnp.int32)),
        seen=state.seen.at[rows, tokens].max(was_active),
    )


def decode(params, state: DecodeState, keep, *, config: ModelConfig, n_steps: int, flags: SamplerFlags):
    """n_steps decode steps for all slots. keep [s] bool: false cancels a slot first.

    Returns (state, tokens [n_steps, s], logprobs [n_steps, s], emitted [n_steps, s] bool).
    """
    state = dataclasses.replace(state, active=state.active & keep)

    def one(state, _):
        logits, cache = forward(
            params,
            config,
            state.tokens[:, None],
            state.positions[:, None],
            state.cache,
            logits_at=jnp.zeros_like(state.tokens),
        )
        state = dataclasses.replace(state, cache=cache)
        tokens, logprobs = sample(logits, state.rows, state.step, flags, state.counts, state.seen)
        was_active = state.active
        return _advance(state, tokens, logprobs, was_active), (tokens, logprobs, was_active)

    if n_steps == 1:
        state, out = one(state, None)
        return state, *(x[None] for x in out)
    state, (tokens, logprobs, emitted) = jax.lax.scan(one, state, None, length=n_steps)
    return state, tokens, logprobs, emitted


def prefill(
    params,
    state: DecodeState,
    prompts,
    lengths,
    slots,
    new_rows: SamplingRows,
    max_tokens,
    limits,
    stop_ids,
    *,
    config: ModelConfig,
    flags: SamplerFlags,
):
    """Run prompts [n, p] (lengths [n]) and put them in decode slots [n] (index >= slots: padding row).

    Returns (state, first tokens [n], logprobs [n], active [n]: false when the first token already ended it).
    """
    n, p = prompts.shape
    cache = empty_cache(config, n, p, state.cache[0][0].dtype)
    positions = jnp.broadcast_to(jnp.arange(p), (n, p))
    logits, cache = forward(params, config, prompts, positions, cache, logits_at=lengths - 1)

    vocab = state.counts.shape[1]
    valid = jnp.arange(p)[None, :] < lengths[:, None]
    seen = jnp.zeros((n, vocab), bool).at[jnp.arange(n)[:, None], prompts].max(valid)
    zeros = jnp.zeros((n,), jnp.int32)
    tokens, logprobs = sample(logits, new_rows, zeros, flags, jnp.zeros((n, vocab), jnp.int32), seen)

    fresh = DecodeState(
        cache=[],
        tokens=tokens,
        positions=lengths - 1,
        active=jnp.ones((n,), bool),
        remaining=max_tokens,
        limit=limits,
        step=zeros,
        stop_ids=stop_ids,
        rows=new_rows,
        counts=jnp.zeros((n, vocab), jnp.int32),
        seen=seen,
    )
    # The first token is sampled as if from a decode step at the prompt's last position.
    fresh = dataclasses.replace(fresh, tokens=jnp.full((n,), -1, jnp.int32))
    fresh = _advance(fresh, tokens, logprobs, jnp.ones((n,), bool))

    def put(big, small):
        return big.at[slots].set(small.astype(big.dtype), mode="drop")

    new_cache = [
        (
            k.at[slots, :, :p].set(nk.astype(k.dtype), mode="drop"),
            v.at[slots, :, :p].set(nv.astype(v.dtype), mode="drop"),
        )
        for (k, v), (nk, nv) in zip(state.cache, cache, strict=True)
    ]
    fields = {
        f.name: put(getattr(state, f.name), getattr(fresh, f.name))
        for f in dataclasses.fields(DecodeState)
        if f.name not in ("cache", "rows", "stop_ids")
    }
    if stop_ids.shape[1] != state.stop_ids.shape[1]:
        raise ValueError("stop_ids width mismatch")
    state = DecodeState(
        cache=new_cache, rows=jax.tree.map(put, state.rows, new_rows), stop_ids=put(state.stop_ids, stop_ids), **fields
    )
    return state, tokens, logprobs, fresh.active
