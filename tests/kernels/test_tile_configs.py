"""Tuned tile files: bucket choice, and every shipped fused_moe / fp8_gemm / MLA decode entry is
launchable."""

import json

import pytest

from rayinfer.kernels.moe.fused_moe_chunks import row_granule
from rayinfer.kernels.tile_configs import CONFIG_DIR, pick_tile_config

TILE_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
OPTIONAL_KEYS = {"USE_TMA", "TAIL_M", "GATE_UP_ONE_DOT", "K_UNROLL"}


def _entries(op):
    path = CONFIG_DIR / f"{op}.json"
    for device, shapes in json.loads(path.read_text()).items():
        if device.startswith("_"):  # notes ("_measured")
            continue
        for shape, buckets in shapes.items():
            for bucket, config in buckets.items():
                yield device, shape, bucket, config


def _check_tile(tile, fp8):
    assert TILE_KEYS <= set(tile) <= TILE_KEYS | OPTIONAL_KEYS, tile
    assert all(tile[key] & (tile[key] - 1) == 0 for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    if fp8:
        assert 128 % tile["BLOCK_K"] == 0, "fp8 K steps must stay inside one 128-wide scale block"


@pytest.mark.parametrize("entry", list(_entries("fused_moe")), ids=lambda e: "/".join(e[:3]))
def test_fused_moe_entries_share_the_row_granule(entry):
    """One alignment serves both GEMMs: their row tiles (TAIL_M of a chunked tile, else
    BLOCK_M) agree; a chunked stage beside a plain one builds its own chunks."""
    _, shape, bucket, config = entry
    assert int(bucket) > 0 and set(config) == {"w13", "w2"}
    for tile in config.values():
        _check_tile(tile, fp8=shape.startswith("fp8"))
        if "TAIL_M" in tile:
            assert tile["BLOCK_M"] % tile["TAIL_M"] == 0
    assert row_granule(config) in (16, 32, 64, 128)


@pytest.mark.parametrize("entry", list(_entries("fp8_gemm")), ids=lambda e: "/".join(e[:3]))
def test_fp8_gemm_entries(entry):
    _check_tile(entry[3], fp8=True)


MLA_KEYS = {"layout", "BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "target_programs",
            "min_tokens_per_split", "max_splits"}  # fmt: skip
MLA_OPTIONS = {"USE_TMA", "WARP_SPECIALIZE", "EVICT_FIRST", "TABLE_IN_LOOP", "whole_waves",
               "programs_per_sm", "COMBINE_BLOCK_L", "COMBINE_MIN_PROGRAMS",
               "fallback"}  # fmt: skip


@pytest.mark.parametrize("entry", list(_entries("mla_attention")), ids=lambda e: "/".join(e[:3]))
def test_mla_decode_entries(entry):
    """Known keys and layouts; a Gluon entry's tiles are the kernel's 64-token tiles, and its
    "fallback" (the Triton tiles where the Gluon kernel cannot run) holds tile keys only."""
    from rayinfer.kernels.mla import mla_decode, mla_decode_hopper

    config = entry[3]
    assert MLA_KEYS <= set(config) <= MLA_KEYS | MLA_OPTIONS, config
    assert config["layout"] in {"tokens_major", "heads_major", *mla_decode.GLUON_LAYOUTS}
    if config["layout"] in mla_decode.GLUON_LAYOUTS:
        assert config["BLOCK_N"] == mla_decode_hopper.BLOCK_SIZE * mla_decode_hopper.TILE_BLOCKS
        assert config["BLOCK_H"] in (16, 32, 64)
        assert set(config.get("fallback", {})) <= (MLA_KEYS | MLA_OPTIONS) - {"layout", "fallback"}
    else:
        assert "fallback" not in config, "only a Gluon entry falls back"


def test_buckets_pick_the_smallest_at_least_m_then_the_largest():
    decode = pick_tile_config("fused_moe", "NVIDIA H200", "bf16,E=256,I=2048,H=7168", 100)
    assert decode["w13"]["BLOCK_M"] == 16
    huge = pick_tile_config("fp8_gemm", "NVIDIA H200", "N=7168,K=2048", 10**6)
    assert huge == pick_tile_config("fp8_gemm", "NVIDIA H200", "N=7168,K=2048", 4096)
    assert pick_tile_config("fp8_gemm", "NVIDIA H200", "N=1,K=1", 1) is not None  # "default"
    assert pick_tile_config("fp8_gemm", "a GPU nobody tuned", "N=7168,K=2048", 1) is None


def test_a_gpu_without_tiles_takes_those_tuned_for_its_architecture(monkeypatch):
    """An H100 (sm_90, no entry of its own) gets the H200's MXFP4 tiles, not the defaults; an
    A100 (sm_80, no GPU tuned for it) gets none; off the GPU, the interpreter's entries."""
    import torch

    from rayinfer.kernels import tile_configs

    gpus = {0: ("NVIDIA H100 80GB HBM3", (9, 0)), 1: ("NVIDIA A100-PCIE-40GB", (8, 0)),
            2: ("NVIDIA H200", (9, 0))}  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: gpus[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: gpus[index][1])
    names = {index: tile_configs._cuda_entry_names.__wrapped__(index) for index in gpus}
    assert names == {0: ("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
                     1: ("NVIDIA A100-PCIE-40GB",), 2: ("NVIDIA H200",)}  # fmt: skip
    shape = "E=256,I=2048,H=4096"
    h100 = pick_tile_config("fused_moe_mxfp4", names[0], shape, 4096)
    assert h100 == pick_tile_config("fused_moe_mxfp4", "NVIDIA H200", shape, 4096)
    assert h100["w13"]["BLOCK_M"] == 128
    assert pick_tile_config("fused_moe_mxfp4", names[1], shape, 4096) is None
    assert tile_configs.tile_entry_names(torch.device("cpu")) == ("cpu",)
