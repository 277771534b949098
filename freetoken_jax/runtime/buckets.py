"""Shape buckets: every step runs at a padded size from a short list, so each executable is
compiled once and reused."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def batch_bucket(n: int, max_batch: int) -> int:
    return min(next_pow2(n), max_batch)


def chunk_bucket(remaining: int, prefill_chunk: int, minimum: int = 16) -> int:
    return min(prefill_chunk, max(minimum, next_pow2(remaining)))
