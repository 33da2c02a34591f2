"""The static shapes the engine's programs are compiled for: cache lengths, prompt lengths and row counts come in
buckets, so that the number of compilations stays small and bounded while padding wastes little. Plain Python: the
scheduler groups requests by these buckets, the device pads its arrays to them.
"""

from __future__ import annotations

# The smallest cache: most chat prompts with their template pass 64 tokens within a few steps, and a cache of 64
# positions would only add its own decode programs for attention that costs little next to the products.
MIN_BUCKET = 128
FINE_BUCKETS_FROM = 128  # cache lengths step by 1.5x from here on, by 2x below (see `bucket`)
# Decode slots by default: larger decode batches run nearer the matrix-product peak, and a slot's cache grows only
# as its sequence does.
DEFAULT_SLOTS = 64
# Decode batch sizes below the slot count: a step over a few active slots runs just those, padded to the next of
# these (a step's cost grows with its rows; see `Scheduler._decode_columns`).
ROW_BUCKETS = (1, 8, 16, 32, 64)


def bucket(n: int, limit: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest cache length >= n (at least `minimum`), capped at `limit`: powers of two, and from 192 up
    also 1.5 times them (192, 256, 384, 512, 768, ...). Attention then reads at most half as many positions
    again as the longest sequence needs, not twice as many; below 128 positions (a `minimum` below MIN_BUCKET)
    they double."""
    size = minimum
    while size < n:
        size = _grow(size, fine=size >= FINE_BUCKETS_FROM)
    return min(size, limit)


def prompt_bucket(n: int, limit: int) -> int:
    """Padded prompt length: a multiple of 16 up to 64, then 1x or 1.5x a power of two (64, 96, 128, 192, ...),
    so that padding wastes at most a third of a prefill while compilations stay few."""
    if n <= 64:
        size = max(16, -(-n // 16) * 16)
    else:
        size = 64
        while size < n:
            size = _grow(size, fine=True)
    return min(size, limit)


# Prompt tokens a packed prefill computes in one call, at most (a longer prompt runs alone): enough rows to keep the
# products at their peak, few enough that its activations stay small next to the weights (8192 x the feed-forward's
# width in float32: 50 MB for SmolLM2, 0.5 GB for Llama-3.1-8B) and that its compiled shapes stay few.
PACKED_TOKENS = 8192
# Prompt tokens a step computes while other slots decode (`EngineOptions.step_tokens`): on a 2-core CPU about two
# seconds of SmolLM2's prefill, in a batch large enough for the products' tiles.
STEP_TOKENS = 2048


# A packed prefill's token count is a multiple of this (`token_bucket`), so that its prompts' log-probabilities may
# be taken this many positions at a time (`step.packed_prompt_logprobs`).
PACKED_STEP = 64


def token_bucket(n: int) -> int:
    """Padded token count of a packed prefill (many prompts' tokens as one batch): a multiple of PACKED_STEP up to
    1024, then of 4 x that, so that padding wastes at most a fifth of a small prefill and little of a large one."""
    step = PACKED_STEP if n <= 1024 else 4 * PACKED_STEP
    return max(step, -(-n // step) * step)


def _grow(size: int, fine: bool) -> int:
    """The next bucket after `size`: 2x, or with `fine`, 1.5x a power of two and then the next power of two."""
    if size & (size - 1):  # 1.5 x a power of two
        return size * 4 // 3
    return size * 3 // 2 if fine else size * 2


def round_up(n: int, multiple: int) -> int:
    """The least multiple of `multiple` >= n: batch sizes are multiples of the mesh's data axis."""
    return -(-n // multiple) * multiple


def pow2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def slot_count(max_slots: int, data: int) -> int:
    """The decode slots of an engine asked for `max_slots` on a mesh whose `data` axis is `data`: a multiple of it."""
    return max(data, round_up(max_slots, data))
