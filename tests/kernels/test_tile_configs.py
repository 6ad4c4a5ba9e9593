"""Tuned tile files: bucket choice, and every shipped fused_moe/fp8_gemm entry is launchable."""

import json

import pytest

from rayinfer.kernels.tile_configs import CONFIG_DIR, pick_tile_config

TILE_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
OPTIONAL_KEYS = {"USE_TMA", "TAIL_M", "GATE_UP_ONE_DOT", "K_UNROLL"}


def _entries(op):
    path = CONFIG_DIR / f"{op}.json"
    for device, shapes in json.loads(path.read_text()).items():
        for shape, buckets in shapes.items():
            for bucket, config in buckets.items():
                yield device, shape, bucket, config


def _check_tile(tile, fp8):
    assert TILE_KEYS <= set(tile) <= TILE_KEYS | OPTIONAL_KEYS, tile
    assert all(tile[key] & (tile[key] - 1) == 0 for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    if fp8:
        assert 128 % tile["BLOCK_K"] == 0, "fp8 K steps must stay inside one 128-wide scale block"


@pytest.mark.parametrize("entry", list(_entries("fused_moe")), ids=lambda e: "/".join(e[:3]))
def test_fused_moe_entries_share_block_m(entry):
    _, shape, bucket, config = entry
    assert int(bucket) > 0 and set(config) == {"w13", "w2"}
    for tile in config.values():
        _check_tile(tile, fp8=shape.startswith("fp8"))
    w13, w2 = config["w13"], config["w2"]
    assert w13["BLOCK_M"] == w2["BLOCK_M"], "one alignment serves both GEMMs"
    assert w13.get("TAIL_M") == w2.get("TAIL_M"), "one chunking serves both GEMMs"


@pytest.mark.parametrize("entry", list(_entries("fp8_gemm")), ids=lambda e: "/".join(e[:3]))
def test_fp8_gemm_entries(entry):
    _check_tile(entry[3], fp8=True)


def test_buckets_pick_the_smallest_at_least_m_then_the_largest():
    decode = pick_tile_config("fused_moe", "NVIDIA H200", "bf16,E=256,I=2048,H=7168", 100)
    assert decode["w13"]["BLOCK_M"] == 16
    huge = pick_tile_config("fp8_gemm", "NVIDIA H200", "N=7168,K=2048", 10**6)
    assert huge == pick_tile_config("fp8_gemm", "NVIDIA H200", "N=7168,K=2048", 4096)
    assert pick_tile_config("fp8_gemm", "NVIDIA H200", "N=1,K=1", 1) is not None  # "default"
    assert pick_tile_config("fp8_gemm", "a GPU nobody tuned", "N=7168,K=2048", 1) is None
