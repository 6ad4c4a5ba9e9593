"""The two-pass top-k of few long rows picks the same values as torch.topk."""

import pytest
import torch

from rayinfer.kernels.segmented_topk import num_segments, topk_indices


@pytest.mark.parametrize(
    "num_rows, row_len, k",
    [(1, 4096, 64), (3, 5000, 100), (16, 131072, 2048), (2, 300, 64), (200, 8192, 64)],
)
def test_selects_the_k_largest_values(num_rows, row_len, k):
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(num_rows, row_len, generator=generator)
    scores[0, -5:] = float("-inf")  # masked positions at a row's end
    ours = topk_indices(scores, k)
    assert ours.shape == (num_rows, k)
    assert all(len(set(row.tolist())) == k for row in ours)  # no position twice
    expected = scores.topk(k, dim=-1).values.sort(dim=-1).values
    torch.testing.assert_close(scores.gather(1, ours).sort(dim=-1).values, expected, rtol=0, atol=0)


def test_segments_only_few_long_rows():
    assert num_segments(16, 131072, 2048) == 16
    assert num_segments(16, 8192, 2048) == 1  # a segment would hold less than 4 x k
    assert num_segments(256, 1 << 20, 2048) == 1  # enough rows to fill the GPU
