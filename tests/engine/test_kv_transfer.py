"""KV hand-off data movement is exact: pack -> object store -> unpack into a cache with another
block size, and K/V heads merged or split between tensor-parallel layouts."""

import pickle

import pytest
import torch

from rayinfer.workers.runner.kv_transfer import (
    KVPayload,
    pack_kv,
    select_kv_heads,
    token_slots,
    unpack_kv,
)


def random_caches(num_layers, num_blocks, block_size, shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, block_size, *shape, generator=generator).to(dtype)
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(80,), (2, 4, 8)], ids=["mla-latent", "gqa"])
def test_pack_travel_unpack_is_bit_exact(ray_cluster, dtype, shape):
    source = random_caches(3, 8, 4, shape, dtype)
    source_slots = token_slots([5, 2, 7], num_tokens=11, block_size=4)
    payload = KVPayload.from_tensors(pack_kv(source, source_slots), generator_state=None)
    assert payload.num_bytes == 3 * 11 * torch.Size(shape).numel() * source[0].element_size()
    travelled = ray_cluster.get(ray_cluster.put(payload))
    assert pickle.loads(pickle.dumps(payload)).shape == payload.shape
    target = [torch.zeros(16, 3, *shape, dtype=dtype) for _ in range(3)]  # block size 3
    target_slots = token_slots([9, 0, 4, 11], num_tokens=11, block_size=3)
    unpack_kv(target, target_slots, travelled.kv)
    for source_layer, target_layer in zip(source, target):
        flat_source = source_layer.view(-1, *shape)[source_slots]
        flat_target = target_layer.view(-1, *shape)[target_slots]
        assert torch.equal(flat_source.view(torch.uint8), flat_target.view(torch.uint8))


def test_heads_split_two_ways_merge_and_reslice_exactly():
    full = torch.randn(5, 2, 4, 8)  # [N, 2, heads, D] of one layer
    halves = [
        KVPayload.from_tensors(
            [full[:, :, 2 * r : 2 * r + 2]], generator_state=None, kv_heads=(2 * r, 2)
        )
        for r in range(2)
    ]
    assert torch.equal(select_kv_heads(halves, (0, 4))[0], full)  # tp=2 -> tp=1
    assert torch.equal(select_kv_heads(halves, (1, 2))[0], full[:, :, 1:3])  # straddles both
    whole = [KVPayload.from_tensors([full], generator_state=None, kv_heads=(0, 4))]
    assert torch.equal(select_kv_heads(whole, (3, 1))[0], full[:, :, 3:4])  # tp=1 -> tp=4


def test_mismatched_layout_is_refused():
    payload = KVPayload.from_tensors([torch.zeros(2, 80)], generator_state=None)
    with pytest.raises(ValueError, match="token shape"):
        unpack_kv([torch.zeros(4, 2, 96)], token_slots([0], 2, 2), payload.kv)
    with pytest.raises(ValueError, match="layers"):
        unpack_kv([torch.zeros(4, 2, 80)] * 2, token_slots([0], 2, 2), payload.kv)
