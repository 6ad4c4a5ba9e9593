"""`python -m rayinfer.bench kernels dsa` without a GPU: it says so and exits 0; its byte
accounting is GLM-5's."""

import torch

from rayinfer.bench import kernels, kernels_dsa


def test_without_cuda_the_group_says_so_and_succeeds(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "dsa" in kernels.groups()
    assert kernels.main(["dsa", "--json", "unused.json"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_bytes_that_sparse_decode_and_the_indexer_must_read():
    row = (512 + 64) * 2  # c_kv and k_pe in bf16
    assert kernels_dsa.attention_bytes(16) == 16 * 2048 * row + 16 * 64 * row
    assert kernels_dsa.indexer_bytes(16, 131072) == 16 * 131072 * 128 * 2
