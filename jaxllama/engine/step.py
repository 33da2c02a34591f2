"""The engine's jitted core, pure functions over a `DecodeState` pytree (donated and returned):

- `prefill`: run new prompts (or the part of them past a prefix another slot holds), sample their first
  tokens and insert them into free decode slots;
- `decode`: advance every slot by `n_steps` tokens, checking end of generation on device.

Shapes are static per call: prompts padded to a length bucket and a row-count bucket, the cache to a
length bucket (`kvcache.py`), so the number of compilations stays small and bounded.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache, forward
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
    tokens,
    starts,
    lengths,
    sources,
    slots,
    seen,
    new_rows: SamplingRows,
    max_tokens,
    limits,
    stop_ids,
    *,
    config: ModelConfig,
    flags: SamplerFlags,
    span: int,
):
    """Run prompts and put them in decode slots.

    Row i computes prompt tokens [starts[i], starts[i] + lengths[i]) given in tokens [n, q] (padded): its
    first starts[i] positions come from the cache of slot sources[i], which holds the same prefix (prefix
    reuse; starts[i] = 0 for a fresh prompt). The row's cache (`span` positions) then lands in slot
    slots[i] (index >= slots: a padding row, dropped). seen [n, vocab]: the whole prompt's tokens, for the
    repetition penalty (or [n, 1] when no row uses penalties).

    Returns (state, first tokens [n], logprobs [n], active [n]: false when the first token already ended it).
    """
    n, q = tokens.shape
    cache = [
        (jnp.take(k[:, :, :span], sources, axis=0, mode="clip"), jnp.take(v[:, :, :span], sources, axis=0, mode="clip"))
        for k, v in state.cache
    ]
    positions = starts[:, None] + jnp.arange(q)[None, :]
    logits, cache = forward(params, config, tokens, positions, cache, logits_at=lengths - 1)

    vocab = state.counts.shape[1]
    if seen.shape[1] != vocab:
        seen = jnp.zeros((n, vocab), bool)
    zeros = jnp.zeros((n,), jnp.int32)
    first, logprobs = sample(logits, new_rows, zeros, flags, jnp.zeros((n, vocab), jnp.int32), seen)

    fresh = DecodeState(
        cache=[],
        tokens=jnp.full((n,), -1, jnp.int32),
        positions=starts + lengths - 1,
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
    fresh = _advance(fresh, first, logprobs, jnp.ones((n,), bool))

    def put(big, small):
        return big.at[slots].set(small.astype(big.dtype), mode="drop")

    new_cache = [
        (
            k.at[slots, :, :span].set(nk.astype(k.dtype), mode="drop"),
            v.at[slots, :, :span].set(nv.astype(v.dtype), mode="drop"),
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
    return state, first, logprobs, fresh.active
