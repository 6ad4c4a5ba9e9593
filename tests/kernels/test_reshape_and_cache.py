"""Writing K/V into the paged cache (Triton, interpreter on CPU): exactly the reference."""

import pytest
import torch

from rayinfer.kernels.attention.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,slots",
    [(1, 1, 16, [5]), (6, 3, 42, [0, 11, -1, 7, 3, 10]), (4, 2, 128, [-1, -1, 2, 1])],
    ids=["one-token", "odd-dims-padding", "mostly-padding"],
)
def test_matches_reference_exactly(num_tokens, num_kv_heads, head_dim, slots, dtype):
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    ours = torch.zeros(3, 4, 2, num_kv_heads, head_dim, dtype=dtype)
    expected = torch.zeros_like(ours)
    slot_mapping = torch.tensor(slots)
    reshape_and_cache(key, value, ours, slot_mapping)
    reshape_and_cache_reference(key, value, expected, slot_mapping)
    assert torch.equal(ours, expected)


def test_non_dense_key_names_the_fix():
    key = torch.randn(2, 4, 16)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        reshape_and_cache(key, key, torch.zeros(1, 4, 2, 2, 16), torch.tensor([0, 1]))
