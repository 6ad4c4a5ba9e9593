"""Varlen causal flash attention (Triton, interpreter on CPU) against per-sequence SDPA."""

import pytest
import torch

from rayinfer.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_reference,
    split_head_dim,
)

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def run_varlen(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v, dtype, is_causal=True):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    query = randn(sum(q_lens), num_heads, dim_qk)
    key = randn(sum(k_lens), num_kv_heads, dim_qk)
    value = randn(sum(k_lens), num_kv_heads, dim_v)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).to(torch.int32)
    args = (cu_q, cu_k, max(q_lens), dim_qk**-0.5, is_causal)
    ours = prefill_attention(query, key, value, *args)
    reference = prefill_attention_reference(query.float(), key.float(), value.float(), *args)
    return ours, reference


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "q_lens,k_lens,num_heads,num_kv_heads,dim_qk,dim_v",
    [
        ([9, 20, 3], [9, 20, 3], 4, 2, 32, 32),  # plain prefill, GQA
        ([6, 1], [42, 1], 6, 6, 48, 32),  # chunks over a prefix; MLA-like split qk 32 + 16
        ([17], [33], 6, 1, 42, 20),  # odd dims: qk 32 + 10, value 20; MQA
    ],
    ids=["gqa-prefill", "mla-dims-chunk", "odd-dims-mqa"],
)
def test_varlen_matches_sdpa(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v, dtype):
    ours, reference = run_varlen(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v, dtype)
    assert ours.shape == (sum(q_lens), num_heads, dim_v) and ours.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


def test_single_token_and_non_causal():
    ours, reference = run_varlen([1], [1], 2, 2, 16, 16, torch.float32)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    ours, reference = run_varlen([5, 19], [12, 19], 2, 1, 16, 16, torch.float32, is_causal=False)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim,split", [(128, (128, 0)), (192, (128, 64)), (42, (32, 10))])
def test_split_head_dim_spends_no_flops_on_padding(head_dim, split):
    assert split_head_dim(head_dim) == split


def test_mismatched_heads_name_the_fix():
    query, key = torch.randn(3, 6, 16), torch.randn(3, 4, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple of kv heads 4"):
        prefill_attention(query, key, key, cu, cu, 3, 1.0)
