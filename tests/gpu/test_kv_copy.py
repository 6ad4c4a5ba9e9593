"""The hand-off's chunked copies on a GPU (device staging, pinned buffers, copy stream) are exact
at DeepSeek-V2-Lite's row (576 bf16) and GLM-5's (704 bf16), across chunk boundaries, with chunks
longer than the importer's staging, and while the compute stream keeps writing other blocks:

    python -m pytest -q -m gpu tests/gpu/test_kv_copy.py
"""

import numpy as np
import pytest
import torch

from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import pack_kv, token_slots

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def random_caches(num_layers, num_blocks, block_size, row, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(num_blocks, block_size, row, generator=generator, device="cuda").to(dtype)
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("row", [576, 704])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 63, 1000, 3700])
def test_gpu_export_import_exact(row, dtype, num_tokens):
    layers, block_size = 5, 64
    blocks = -(-num_tokens // block_size)
    source = random_caches(layers, 2 * blocks + 3, block_size, row, dtype, seed=1)
    table = list(range(2 * blocks + 2, 2 * blocks + 2 - 2 * blocks, -2))  # scattered
    slots = token_slots(table, num_tokens, block_size)
    row_bytes = row * dtype.itemsize
    exporter = KVCopier(source, chunk_bytes=layers * row_bytes * 257)  # 257-token chunks
    chunks = [chunk.copy() for chunk in exporter.export(slots)]
    expected = pack_kv(source, slots)
    whole = torch.from_numpy(np.concatenate(chunks, axis=1))
    for layer, rows in enumerate(expected):
        assert torch.equal(whole[layer], rows.view(torch.uint8).reshape(num_tokens, -1))

    target = random_caches(layers, blocks * 4 + 4, 16, row, dtype, seed=2)  # block size 16
    target_table = list(range(3, 3 + -(-num_tokens // 16)))
    target_slots = token_slots(target_table, num_tokens, 16)
    before = [t.clone() for t in target]
    importer = KVCopier(target, chunk_bytes=layers * row_bytes * 100)  # shorter than the chunks
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):  # work queued on the compute stream meanwhile
        busy = busy @ busy / 64
    importer.import_(target_slots, chunks)
    for layer, rows in enumerate(expected):
        got = target[layer].view(-1, row)[target_slots].cpu()
        assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))
        others = torch.ones(target[layer].shape[0] * 16, dtype=torch.bool, device="cuda")
        others[target_slots.cuda()] = False
        assert torch.equal(target[layer].view(-1, row)[others], before[layer].view(-1, row)[others])
