"""Cache and prompt length buckets: few sizes, bounded waste, never past the limit."""

import pytest

from jaxllama.engine import buckets


def test_cache_buckets_start_at_128_then_step_by_half():
    sizes = sorted({buckets.bucket(n, 1 << 20) for n in range(1, 3000)})
    assert sizes == [128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072]
    assert sorted({buckets.bucket(n, 1 << 20, minimum=16) for n in range(1, 200)}) == [16, 32, 64, 128, 192, 256]


@pytest.mark.parametrize("n", [1, 64, 65, 129, 193, 257, 385, 1000, 2049])
def test_cache_bucket_holds_n_and_wastes_at_most_half_again_past_128(n):
    size = buckets.bucket(n, 1 << 20)
    assert size >= n
    assert size <= max(128, 1.5 * n)


def test_cache_bucket_is_capped_at_the_limit_and_starts_at_the_minimum():
    assert buckets.bucket(300, 300) == 300
    assert buckets.bucket(5000, 4096) == 4096
    assert buckets.bucket(1, 4096, minimum=16) == 16


def test_prompt_buckets():
    lengths = (1, 16, 17, 64, 65, 97, 129, 200)
    assert [buckets.prompt_bucket(n, 4096) for n in lengths] == [16, 16, 32, 64, 96, 128, 192, 256]
    assert buckets.prompt_bucket(300, 200) == 200
