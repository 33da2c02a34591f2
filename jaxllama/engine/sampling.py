"""Per-request sampling parameters, and the batched on-device sampler that applies them row by row.

Every row of a batch carries its own parameters, so greedy, temperature, top-k/top-p/min-p and penalty
requests share one decode step. Randomness comes from each request's own key, folded with the index of
the token being drawn: the same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllama.core.ops import XLA, Ops, logprob_of
from jaxllama.engine.request import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingRows:
    """SamplingParams of every row, as arrays [rows] (the device-side form)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    min_tokens: jax.Array
    key: jax.Array  # [rows, 2] uint32 raw PRNG key data
    bias_ids: jax.Array  # [rows, MAX_LOGIT_BIAS] int32: logit_bias token ids, padded with -1
    bias_values: jax.Array  # [rows, MAX_LOGIT_BIAS] float32: what each adds to its token's logit

    @staticmethod
    def from_params(params: list[SamplingParams], seeds: list[int]) -> dict:
        """Host-side numpy arrays for these requests (seeds already resolved)."""
        import numpy as np

        def col(name, dtype):
            return np.array([getattr(p, name) for p in params], dtype)

        bias_ids = np.full((len(params), MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((len(params), MAX_LOGIT_BIAS), np.float32)
        for i, p in enumerate(params):
            for j, (token, bias) in enumerate(p.logit_bias):
                bias_ids[i, j], bias_values[i, j] = token, bias

        return dict(
            temperature=col("temperature", np.float32),
            top_k=col("top_k", np.int32),
            top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32),
            min_tokens=col("min_tokens", np.int32),
            key=np.stack([np.array([s >> 32 & 0xFFFFFFFF, s & 0xFFFFFFFF], np.uint32) for s in seeds])
            if seeds
            else np.zeros((0, 2), np.uint32),
            bias_ids=bias_ids,
            bias_values=bias_values,
        )


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static switches: the sampler compiles only the work some row in the batch needs."""

    full: bool = False  # some row samples from the whole vocabulary (temperature > 0, no top_k/top_p)
    filter: bool = False  # some row samples with top_k or top_p (among the CANDIDATES most likely tokens)
    penalize: bool = False  # some row uses a penalty
    hold_stops: bool = False  # some row has min_tokens: its stop ids are not sampled before them
    bias: bool = False  # some row has a logit_bias
    mask: bool = False  # some row samples only among the tokens a bitmask allows (structured output)
    top: bool = False  # some row asks for top_logprobs: every row's MAX_LOGPROBS most likely tokens are reported

    @property
    def sample(self) -> bool:
        return self.full or self.filter

    @staticmethod
    def of(params) -> SamplerFlags:
        params = list(params)
        return SamplerFlags(
            full=any(not p.greedy and not p.filtered for p in params),
            filter=any(p.filtered for p in params),
            penalize=any(p.penalized for p in params),
            hold_stops=any(p.min_tokens > 0 for p in params),
            bias=any(p.logit_bias for p in params),
            top=any(p.top_logprobs > 0 for p in params),
        )


# top_k / top_p rows choose among this many most likely tokens: a full sort of the vocabulary costs ~100x
# more on the CPU. top_k <= CANDIDATES is exact; a top_p nucleus larger than this is cut to it.
CANDIDATES = 256


def apply_penalties(logits, rows: SamplingRows, counts, seen):
    """logits [b, v]; counts [b, v] generated-token counts; seen [b, v] prompt or generated tokens."""
    rp = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    counts = counts.astype(jnp.float32)
    return logits - rows.presence_penalty[:, None] * (counts > 0) - rows.frequency_penalty[:, None] * counts


def candidate_mask(probs, rows: SamplingRows):
    """Which of the candidates probs [b, c] (sorted descending, as fractions of the whole distribution) survive
    top_k, top_p (the smallest head whose mass reaches top_p) and min_p (relative to the most likely)."""
    rank = jnp.arange(probs.shape[-1])[None, :]
    keep = (rows.top_k[:, None] <= 0) | (rank < rows.top_k[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the candidates ranked above
    keep &= (before < rows.top_p[:, None]) | (rank == 0)
    return keep & (probs >= rows.min_p[:, None] * probs[:, :1])


def hold_stops(logits, rows: SamplingRows, step, stop_ids):
    """logits [b, v] with each row's stop ids stop_ids [b, e] (padded with -1) at -inf while step < min_tokens."""
    held = (step < rows.min_tokens)[:, None] & (stop_ids >= 0)
    at = jnp.arange(logits.shape[0])[:, None]
    return logits.at[at, jnp.maximum(stop_ids, 0)].min(jnp.where(held, -jnp.inf, jnp.inf))


def apply_bias(logits, rows: SamplingRows):
    """logits [b, v] with each row's logit_bias added (OpenAI's: before temperature and sampling)."""
    at = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(rows.bias_ids >= 0, rows.bias_ids, logits.shape[-1])  # padding lands nowhere
    return logits.at[at, ids].add(rows.bias_values, mode="drop")


def apply_mask(logits, mask):
    """logits [b, v] at -inf where the bitmask mask [b, ceil(v / 32)] int32 (bit t % 32 of word t // 32: token t
    allowed, llguidance's layout) has a 0."""
    token = jnp.arange(logits.shape[-1])
    allowed = (jnp.right_shift(mask[:, token // 32], (token % 32)[None, :]) & 1) == 1
    return jnp.where(allowed, logits, -jnp.inf)


class RowHistory(NamedTuple):
    """What each row drew before, as the sampler reads it: step [b] (tokens drawn so far: folded into the random
    key, and stop ids are held while it is below min_tokens), stop_ids [b, e] (end-of-generation ids, padded with
    -1), counts [b, v] (generated-token counts) and seen [b, v] (prompt or generated tokens), for the penalties."""

    step: jax.Array
    stop_ids: jax.Array | None = None
    counts: jax.Array | None = None
    seen: jax.Array | None = None


def sample(logits, rows: SamplingRows, history: RowHistory, flags: SamplerFlags, ops: Ops = XLA, mask=None):
    """Draw one token per row. logits [b, v] float32; an all-greedy batch takes its tokens from `ops.greedy`. mask
    [b, ceil(v / 32)] int32 (with `flags.mask`): the tokens each row may draw, as a bitmask (all ones: any).

    Returns (tokens [b] int32, logprobs [b] float32: log-probability of each token under the model's
    distribution after penalties and temperature, before top-k/top-p/min-p truncation, top: `top_logprobs`' pair
    from that same distribution, with `flags.top`, else None).
    """
    step = history.step
    if flags.hold_stops:
        logits = hold_stops(logits, rows, step, history.stop_ids)
    if flags.penalize:
        logits = apply_penalties(logits, rows, history.counts, history.seen)
    if flags.bias:
        logits = apply_bias(logits, rows)
    if flags.mask:
        logits = apply_mask(logits, mask)
    top = top_logprobs(logits, rows, ops) if flags.top else None
    if not flags.sample:
        return *ops.greedy(logits), top
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    neg = jnp.finfo(jnp.float32).min
    scaled = logits / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    logz = ops.logsumexp(scaled)[:, None]
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(rows.key, step)
    tokens = greedy
    if flags.full:  # exact sampling over the whole vocabulary (Gumbel-max), min_p as a threshold
        floor = jnp.log(jnp.maximum(rows.min_p, 1e-30))[:, None] + jnp.max(scaled, axis=-1, keepdims=True)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        drawn = jnp.argmax(jnp.where(scaled >= floor, scaled + gumbel, neg), axis=-1).astype(jnp.int32)
        tokens = jnp.where(rows.temperature > 0, drawn, tokens)
    if flags.filter:
        values, index = jax.lax.top_k(scaled, min(CANDIDATES, logits.shape[-1]))
        keep = candidate_mask(jnp.exp(values - logz), rows)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (values.shape[-1],), jnp.float32))(keys)
        choice = jnp.argmax(jnp.where(keep, values + gumbel, neg), axis=-1)
        drawn = jnp.take_along_axis(index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        filtered = (rows.temperature > 0) & ((rows.top_k > 0) | (rows.top_p < 1))
        tokens = jnp.where(filtered, drawn, tokens)
    sampled = rows.temperature > 0
    scaled_lp = jnp.take_along_axis(scaled - logz, tokens[:, None], axis=-1)[:, 0]
    return tokens, jnp.where(sampled, scaled_lp, logprob_of(logits, tokens, ops)), top


def top_logprobs(logits, rows: SamplingRows, ops: Ops = XLA):
    """The MAX_LOGPROBS most likely tokens of each row and their log-probabilities, in the distribution a sampled
    token's log-probability is reported from: logits [b, v] (after penalties) divided by the row's temperature, or
    as they are for a greedy row. Temperature keeps the order, so the candidates are the logits' own top.
    -> (ids [b, k] int32, logprobs [b, k] float32), the most likely first."""
    values, ids = jax.lax.top_k(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    logz = ops.logsumexp(logits / t)[:, None]
    return ids.astype(jnp.int32), values / t - logz
