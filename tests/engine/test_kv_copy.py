"""The hand-off's chunked copies (workers/runner/kv_copy.py) are exact on the CPU: chunk boundaries,
another block size and chunk size on the way in, every dtype and row shape the caches hold.
(tests/gpu/test_kv_copy.py checks the pinned/staged CUDA path the same way.)"""

import numpy as np
import pytest
import torch

from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import KVPayload, pack_kv, token_slots


def random_caches(num_layers, num_blocks, block_size, shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, block_size, *shape, generator=generator).to(dtype)
        for _ in range(num_layers)
    ]


def tokens_per_chunk_bytes(caches, tokens: int) -> int:
    row_bytes = caches[0][0, 0].numel() * caches[0].element_size()
    return len(caches) * row_bytes * tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("shape", [(80,), (2, 4, 8), (1, 592)], ids=["mla", "gqa", "dsa-row"])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 11, 64])
def test_export_then_import_is_bit_exact(dtype, shape, chunk_tokens):
    source = random_caches(3, 8, 4, shape, dtype)
    slots = token_slots([5, 2, 7], num_tokens=11, block_size=4)
    copier = KVCopier(source, chunk_bytes=tokens_per_chunk_bytes(source, chunk_tokens))
    chunks = [chunk.copy() for chunk in copier.export(slots)]  # buffers are reused
    assert [c.shape[1] for c in chunks] == [e - s for s, e in copier.chunk_bounds(11)]
    assert sum(c.shape[1] for c in chunks) == 11 and max(c.shape[1] for c in chunks) <= chunk_tokens
    reference = pack_kv(source, slots)
    whole = torch.from_numpy(np.concatenate(chunks, axis=1))  # [layers, 11, row_bytes]
    for layer, expected in enumerate(reference):
        assert torch.equal(whole[layer], expected.contiguous().view(torch.uint8).reshape(11, -1))

    target = [torch.zeros(16, 3, *shape, dtype=dtype) for _ in range(3)]  # block size 3
    target_slots = token_slots([9, 0, 4, 11], num_tokens=11, block_size=3)
    KVCopier(target, chunk_bytes=tokens_per_chunk_bytes(target, 2)).import_(target_slots, chunks)
    for layer, expected in enumerate(reference):
        got = target[layer].view(-1, *shape)[target_slots]
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    untouched = torch.ones(16 * 3, dtype=torch.bool)
    untouched[target_slots] = False
    assert not target[0].view(-1, *shape)[untouched].any()  # nothing written elsewhere


def test_payload_views_and_sizes_agree():
    source = random_caches(2, 4, 4, (2, 3, 5), torch.bfloat16)
    slots = token_slots([3, 1], num_tokens=7, block_size=4)
    kv = pack_kv(source, slots)
    payload = KVPayload.from_tensors(kv, generator_state=None)
    assert payload.num_bytes == 2 * 7 * 30 * 2 == sum(chunk.nbytes for chunk in payload.chunks)
    assert all(torch.equal(a, b) for a, b in zip(payload.kv, kv))
    copier = KVCopier(source, chunk_bytes=tokens_per_chunk_bytes(source, 2))
    split = payload.with_chunks([chunk.copy() for chunk in copier.export(slots)])
    assert len(split.chunks) == 4 and all(torch.equal(a, b) for a, b in zip(split.kv, kv))
