"""fused_moe (Triton grouped GEMM over expert tiles) against the torch references, bf16-free:
the interpreter runs float32/float16 here; bf16 and FP8 at DeepSeek-V3 size run in the benchmark."""

import pytest
import torch

from rayinfer.kernels import ops
from rayinfer.kernels.fp8.fp8_quant import fp8_quant
from rayinfer.kernels.moe.fused_moe import (
    _launch_gemm,
    expert_chunks,
    fused_moe,
    fused_moe_fp8_reference,
    fused_moe_reference,
    quantizes_in_epilogue,
    row_granule,
)
from rayinfer.kernels.moe.moe_align import moe_align
from rayinfer.models.fp8 import quantize_block_fp8

SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
SMALL_TILES = {"w13": SMALL, "w2": SMALL}
TMA_TILES = {"w13": {**SMALL, "USE_TMA": True}, "w2": {**SMALL, "USE_TMA": True}}
# One program per chunk of an expert's rows: 16 main rows + 8 tail rows, 8-row tiles.
CHUNK = {**SMALL, "TAIL_M": 8}
CHUNK_TILES = {"w13": CHUNK, "w2": CHUNK}
CHUNK_TMA_TILES = {"w13": {**CHUNK, "USE_TMA": True}, "w2": {**CHUNK, "USE_TMA": True}}
# gate+up as one dot: each weight tile holds 16 gate rows then the 16 matching up rows.
ONE_DOT = {**CHUNK, "GATE_UP_ONE_DOT": True}
ONE_DOT_TILES = {"w13": ONE_DOT, "w2": CHUNK}
ONE_DOT_TMA_TILES = {"w13": {**ONE_DOT, "USE_TMA": True}, "w2": {**CHUNK, "USE_TMA": True}}
WIDE_N = {**SMALL, "BLOCK_N": 256, "BLOCK_K": 128}
WIDE_N_FP8_TILES = {"w13": WIDE_N, "w2": WIDE_N}
# 32 main rows + 8 tail rows: chunks of up to 5 tiles of 8 rows.
FIVE_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "TAIL_M": 8}
FIVE_TILE_CHUNKS = {
    "w13": {**FIVE_TILES, "GATE_UP_ONE_DOT": True, "USE_TMA": True},
    "w2": FIVE_TILES,
}
# Plain 8-row tiles for gate+up, chunks for down (one row granule: 8): w2 builds its own chunks.
PLAIN_THEN_CHUNKS = {"w13": {**SMALL, "BLOCK_M": 8, "USE_TMA": True}, "w2": CHUNK}

CASES = {
    "normal": dict(T=16, H=64, I=32, E=8, K=2),
    "odd": dict(T=6, H=123, I=42, E=5, K=3),
    "one_token": dict(T=1, H=64, I=32, E=4, K=2),
    "all_one_expert": dict(T=10, H=64, I=32, E=4, K=1, one_expert=True),
    "topk_equals_experts": dict(T=5, H=48, I=16, E=4, K=4),
    "idle_experts": dict(T=4, H=64, I=32, E=16, K=2, E_routed=3),
    "foreign_ids": dict(T=9, H=64, I=32, E=6, K=3, foreign=True),
    "long_runs": dict(T=40, H=64, I=32, E=3, K=2),  # 20-40 rows per expert: several chunks
    "all_to_one_long": dict(T=61, H=32, I=16, E=2, K=1, one_expert=True),  # 61 rows, 8 tiles
}


def _routing(case, generator):
    num_tokens, top_k = case["T"], case["K"]
    logits = torch.randn(num_tokens, case.get("E_routed", case["E"]), generator=generator)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    if case.get("one_expert"):
        ids = torch.full_like(ids, 1)
    if case.get("foreign"):  # held by other ranks (below and above this one's): contribute nothing
        ids[::2, 0] = -1
        ids[1::3, -1] = case["E"] + 2
    return weights, ids


def _problem(case, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, experts = case["H"], case["I"], case["E"]
    x = torch.randn(case["T"], hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) / inter**0.5
    weights, ids = _routing(case, generator)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_moe_matches_reference(name, dtype, tol):
    x, w13, w2, weights, ids = _problem(CASES[name], dtype, seed=len(name))
    out = fused_moe(x, w13, w2, weights, ids, config=SMALL_TILES)
    expected = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "tiles",
    [
        CHUNK_TILES,
        CHUNK_TMA_TILES,
        ONE_DOT_TILES,
        ONE_DOT_TMA_TILES,
        FIVE_TILE_CHUNKS,
        PLAIN_THEN_CHUNKS,
    ],
    ids=["pointer", "tma", "one_dot", "one_dot_tma", "five_tiles", "plain_then_chunks"],
)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_moe_expert_chunks(name, tiles):
    """Main + tail row tiles per program, all edge cases: empty experts, one expert, one token."""
    x, w13, w2, weights, ids = _problem(CASES[name], torch.float32, seed=len(name) + 1)
    out = fused_moe(x, w13, w2, weights, ids, config=tiles)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _reference_chunks(block_expert_ids, tiles_per_chunk):
    """(first tile, tile count) of every chunk: each expert's n tiles in ceil(n / tiles_per_chunk)
    chunks, sizes as equal as they go, larger first."""
    ids = [expert for expert in block_expert_ids.tolist() if expert >= 0]
    chunks, tile = [], 0
    while tile < len(ids):
        run = ids.count(ids[tile])
        num_chunks = -(-run // tiles_per_chunk)
        for index in range(num_chunks):
            size = run // num_chunks + (index < run % num_chunks)
            chunks.append([tile, size])
            tile += size
    return chunks


@pytest.mark.parametrize(
    "counts", [[0, 5, 0, 40, 9], [1], [0, 0, 0], [24, 25, 8, 0, 17, 50], [9000, 3, 0, 1100]]
)
def test_expert_chunks_cut_runs(counts):
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)] + [torch.zeros(0)])
    ids = ids.long()[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))]
    num_experts = len(counts)
    alignment = moe_align(ids.view(-1, 1), num_experts, 8)
    for tile, tiles_per_chunk in (
        ({"BLOCK_M": 16, "TAIL_M": 8}, 3),
        ({"BLOCK_M": 32, "TAIL_M": 8}, 5),
    ):
        chunks = expert_chunks(alignment, ids.numel(), num_experts, tile)
        got = []
        for row, with_tail in enumerate((False, True)):  # list 0: main rows only; 1: with tail
            count = int(chunks.num_chunks[row])
            assert count <= chunks.max_chunks[row]
            sizes = chunks.num_tiles[row, :count]
            assert ((sizes * tile["TAIL_M"] > tile["BLOCK_M"]) == with_tail).all()
            got += torch.stack([chunks.first_tile[row, :count], sizes], 1).tolist()
        assert sorted(got) == _reference_chunks(alignment.block_expert_ids, tiles_per_chunk)
        # Both lists start on 16 bytes whatever the count: the GEMMs see one pointer alignment
        # (Triton specializes on it), so no variant compiles for a new batch size.
        for lists in (chunks.first_tile, chunks.num_tiles):
            assert all(lists[row].data_ptr() % 16 == 0 for row in (0, 1))


@pytest.mark.parametrize("name", ["normal", "odd", "foreign_ids"])
def test_fused_moe_tma_weight_tiles(name):
    """Expert weights read through a TMA descriptor (odd K falls back to pointer loads)."""
    x, w13, w2, weights, ids = _problem(CASES[name], torch.float32, seed=7)
    out = fused_moe(x, w13, w2, weights, ids, config=TMA_TILES)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fused_moe_default_tiles():
    x, w13, w2, weights, ids = _problem(dict(T=20, H=96, I=64, E=3, K=2), torch.float32, seed=1)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected)


def _quantize_experts(w):
    """[E, N, K] -> ([E, N, K] float8_e4m3fn, [E, N/128, K/128] float32 block scales)."""
    pairs = [quantize_block_fp8(expert) for expert in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


@pytest.mark.parametrize(
    "case",
    [
        dict(T=8, H=256, I=128, E=4, K=2),
        dict(T=5, H=200, I=72, E=3, K=3, foreign=True),
        dict(T=7, H=384, I=256, E=3, K=2),
    ],
    ids=["aligned", "partial_blocks", "two_scale_blocks"],
)
def test_fused_moe_fp8_block_scales(case):
    x, w13, w2, weights, ids = _problem(case, torch.float32, seed=case["T"])
    w13_q, w13_scale = _quantize_experts(w13)
    w2_q, w2_scale = _quantize_experts(w2)
    expected = fused_moe_fp8_reference(x, w13_q, w2_q, weights, ids, w13_scale, w2_scale)
    # SMALL/TMA: one weight scale per tile and K step where I is a multiple of 128 (the up rows
    # start on a block), a scale per column else; WIDE_N: 256 columns, two scale blocks a tile
    for tiles in (SMALL_TILES, TMA_TILES, CHUNK_TILES, ONE_DOT_TILES, ONE_DOT_TMA_TILES,
                  WIDE_N_FP8_TILES):  # fmt: skip
        out = fused_moe(x, w13_q, w2_q, weights, ids, w13_scale, w2_scale, config=tiles)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # FP8 activations and weights stay within a few percent of the unquantized experts.
    unquantized = fused_moe_reference(x, w13, w2, weights, ids)
    assert (out - unquantized).norm() / unquantized.norm() < 0.08


# gate+up tiles whose output columns are whole 128-channel groups: the plain kernel, chunks of
# rows (main + tail), and gate and up as one dot (256 weight rows make 128 output columns).
QUANTIZING_TILES = {
    "plain": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 2},
    "chunks": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 2, "TAIL_M": 8},
    "one_dot": {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 2, "TAIL_M": 8,
                "GATE_UP_ONE_DOT": True},
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(QUANTIZING_TILES))
def test_gate_up_writes_the_fp8_activations_fp8_quant_would(name, dtype):
    """The gate+up epilogue's FP8 activations and scales are, byte for byte, fp8_quant's of the
    activations the same tile writes in x's dtype (the pass it replaces)."""
    case = dict(T=7, H=256, I=256, E=3, K=2, foreign=True)
    x, w13, _, weights, ids = _problem(case, torch.float32, seed=11)
    w13_q, w13_scale = _quantize_experts(w13)
    x_in, x_scale = fp8_quant(x.to(dtype))
    tile = QUANTIZING_TILES[name]
    config = {"w13": tile, "w2": tile}
    assert quantizes_in_epilogue(tile, case["I"])
    alignment = moe_align(ids, case["E"], row_granule(config))
    num_slots = ids.numel()
    chunks = expert_chunks(alignment, num_slots, case["E"], tile) if "TAIL_M" in tile else None
    common = (x_in, w13_q)
    act = torch.zeros(num_slots, case["I"], dtype=dtype)
    _launch_gemm(*common, act, x_scale, w13_scale, weights, alignment, "w13", config, case["K"],
                 chunks)  # fmt: skip
    act_q = torch.zeros(num_slots, case["I"], dtype=torch.float8_e4m3fn)
    act_scale = torch.zeros(num_slots, case["I"] // 128)
    _launch_gemm(*common, act_q, x_scale, w13_scale, weights, alignment, "w13", config,
                 case["K"], chunks, c_scale=act_scale, act_dtype=dtype)  # fmt: skip
    want_q, want_scale = fp8_quant(act)
    held = ((ids >= 0) & (ids < case["E"])).reshape(-1)  # other slots are never written
    assert held.any() and not held.all()
    assert torch.equal(act_q[held].view(torch.uint8), want_q[held].view(torch.uint8))
    assert torch.equal(act_scale[held], want_scale[held])


def test_a_tile_that_splits_a_quantization_group_is_refused():
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 2}
    assert not quantizes_in_epilogue(tile, 256)
    assert not quantizes_in_epilogue({**tile, "BLOCK_N": 128}, 192)  # 1.5 tiles of columns
    case = dict(T=2, H=128, I=128, E=2, K=1)
    x, w13, _, weights, ids = _problem(case, torch.float32, seed=1)
    w13_q, w13_scale = _quantize_experts(w13)
    x_in, x_scale = fp8_quant(x)
    config = {"w13": tile, "w2": tile}
    alignment = moe_align(ids, case["E"], row_granule(config))
    act_q = torch.zeros(2, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cannot quantize its output"):
        _launch_gemm(x_in, w13_q, act_q, x_scale, w13_scale, weights, alignment, "w13", config,
                     1, c_scale=torch.zeros(2, 1), act_dtype=torch.float32)  # fmt: skip


def test_ops_fused_moe_fp8_reference_path_dequantizes():
    case = dict(T=4, H=128, I=128, E=2, K=1)
    x, w13, w2, weights, ids = _problem(case, torch.float32, seed=3)
    (w13_q, w13_scale), (w2_q, w2_scale) = _quantize_experts(w13), _quantize_experts(w2)
    out = ops.fused_moe(x, w13_q, w2_q, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale)
    unquantized = fused_moe_reference(x, w13, w2, weights, ids)
    assert (out - unquantized).norm() / unquantized.norm() < 0.05


def test_fused_moe_names_mismatched_shapes():
    x, w13, w2, weights, ids = _problem(CASES["normal"], torch.float32, seed=0)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe(x, w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), weights, ids)
