"""The DSA cache write (Triton, interpreter on CPU) against the torch reference: exact, padding
slots skipped, rows wider than what is written, layers with and without the indexer key."""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_cache import dsa_write_cache
from rayinfer.kernels.dsa.dsa_indexer import dsa_write_cache_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_tokens, latent_rank, rope_dim, index_dim, row_width, with_key",
    [
        (5, 16, 8, 16, 40, True),  # a whole row
        (7, 24, 8, 12, 48, True),  # odd sizes, a row wider than what is written
        (4, 16, 8, 16, 40, False),  # a shared layer: its key columns untouched
        (1, 64, 16, 32, 112, True),  # a single token
    ],
)
def test_write_equals_reference(
    num_tokens, latent_rank, rope_dim, index_dim, row_width, with_key, dtype
):
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 4, row_width, generator=generator).to(dtype)
    slots = torch.randperm(24, generator=generator)[:num_tokens]
    slots[0] = -1  # a padding row: nothing written
    kv_c = torch.randn(num_tokens, latent_rank, generator=generator)
    k_pe = torch.randn(num_tokens, rope_dim, generator=generator)
    key = torch.randn(num_tokens, index_dim, generator=generator) if with_key else None
    expected = cache.clone()
    dsa_write_cache_reference(expected, slots, kv_c, k_pe, key)
    dsa_write_cache(cache, slots, kv_c, k_pe, key)
    assert torch.equal(cache, expected)


def test_rows_too_narrow_are_refused():
    cache = torch.zeros(2, 4, 30)
    with pytest.raises(ValueError, match="rows of at least 16 \\+ 8 \\+ 16"):
        dsa_write_cache(
            cache, torch.zeros(1, dtype=torch.long), torch.zeros(1, 16), torch.zeros(1, 8),
            torch.zeros(1, 16),
        )  # fmt: skip
