"""The MXFP4 dequantizations' inline PTX, run bit for bit by tests/kernels/ptx_emulator.py
against the format's definition (Triton's interpreter runs no PTX; tests/gpu runs them on a
GPU): every byte in every position, scales from 2^-127 to 2^123, the folded form only where
its scales are at most 2. A block's operands: $0-$3 out, $4 the packed weights, then the
bf16x2 scale factors."""

import random

import pytest

from rayinfer.kernels.moe import fused_moe_mxfp4_kernel as split_kernel
from rayinfer.kernels.moe import fused_moe_mxfp4_quad as quad_kernel
from rayinfer.kernels.moe.fused_moe_mxfp4 import E2M1_VALUES
from tests.kernels.ptx_emulator import float_to_bf16, run_ptx

SCALES = (0, 1, 2, 60, 100, 119, 120, 126, 127, 128, 129, 150, 200, 250)


def value_bits(nibble: int, scale: int) -> int:
    """bf16 bits of E2M1[nibble] * 2^(scale - 127), exact."""
    return float_to_bf16(E2M1_VALUES[nibble] * 2.0 ** (scale - 127))


def pair(low: int, high: int) -> int:
    return low | (high << 16)


def factors(form: str, scale: int) -> list[int]:
    """The bf16 bits each form multiplies by, for one scale byte."""
    if form == "shift":
        return [scale << 7]
    if form == "fold":
        return [(scale + 126) << 7]
    return [(min(scale, 128) + 126) << 7, (max(scale, 128) - 1) << 7]


def every_byte_everywhere(rng: random.Random) -> list[tuple[int, int, int, int]]:
    """Each byte value in each of the four positions, the others random."""
    sets = []
    for position in range(4):
        for byte in range(256):
            four = [rng.randrange(256) for _ in range(4)]
            four[position] = byte
            sets.append(tuple(four))
    return sets


def cases(form: str, rng: random.Random) -> list[tuple[int, int, list]]:
    """(scale of elements/words 0-1, of 2-3, byte sets): every byte at two trained-like scales,
    then 32 random sets at each pair of the form's scales (the same, and the largest)."""
    usable = [s for s in SCALES if (form != "fold" or s <= 128) and (form != "shift" or s > 0)]
    every = [(119, 121, every_byte_everywhere(rng))]
    return every + [
        (s, t, [tuple(rng.randrange(256) for _ in range(4)) for _ in range(32)])
        for s in usable
        for t in (s, usable[-1])
    ]


def test_split_kernel_block_gives_each_bytes_nibbles():
    """Bytes b0-b3 (elements 0-3) -> $0 (lo b0, lo b1), $1 (lo b2, lo b3), $2 (hi b0, hi b1),
    $3 (hi b2, hi b3); elements 0-1 take one scale, 2-3 another."""
    asm, form = split_kernel._E2M1_TO_BF16_ASM.value, "shift"
    for s01, s23, byte_sets in cases(form, random.Random(0)):
        f01, f23 = factors(form, s01), factors(form, s23)
        scale_operands = [pair(f, f) for f in f01[:1] + f23[:1]]
        scale_operands += [pair(f, f) for f in f01[1:] + f23[1:]]
        for b in byte_sets:
            packed = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
            out = run_ptx(asm, [0, 0, 0, 0, packed, *scale_operands])[:4]
            lo = [value_bits(x & 15, s) for x, s in zip(b, (s01, s01, s23, s23))]
            hi = [value_bits(x >> 4, s) for x, s in zip(b, (s01, s01, s23, s23))]
            expected = [pair(lo[0], lo[1]), pair(lo[2], lo[3]), pair(hi[0], hi[1]),
                        pair(hi[2], hi[3])]  # fmt: skip
            assert out == expected, (b, s01, s23, [hex(v) for v in out])


# (scale form, table in a register: the lanemask form, LUT_REG) -> the block
QUAD_FORMS = {
    ("fold", False): quad_kernel.WORD_LOOKUP_FOLD_ASM,
    ("two_factors", False): quad_kernel.WORD_LOOKUP_ASM,
    ("fold", True): quad_kernel.WORD_LOOKUP_FOLD_REG_ASM,
    ("two_factors", True): quad_kernel.WORD_LOOKUP_REG_ASM,
}


@pytest.mark.parametrize("form, lut_reg", list(QUAD_FORMS))
def test_quad_kernel_block_gives_each_lane_of_two_words(form, lut_reg):
    """Words i (bytes b0 b1) and i + 1 (b2 b3), each with its scale -> $0 lane 0 (lo b0, lo b2),
    $1 lane 2 (lo b1, lo b3), $2 lane 1 (hi b0, hi b2), $3 lane 3 (hi b1, hi b3); in every warp
    lane (the lanemask form's table must not depend on it)."""
    asm = QUAD_FORMS[(form, lut_reg)].value
    for s_i, s_next, byte_sets in cases(form, random.Random(1)):
        scale_operands = [pair(a, b) for a, b in zip(factors(form, s_i), factors(form, s_next))]
        for index, b in enumerate(byte_sets):
            packed = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
            operands = [0, 0, 0, 0, packed, *scale_operands]
            out = run_ptx(asm, operands, lane=index % 32)[:4]
            first, second = (b[0], b[2]), (b[1], b[3])  # each word's first and second byte
            scales = (s_i, s_next)
            lane = {
                0: [value_bits(x & 15, s) for x, s in zip(first, scales)],
                1: [value_bits(x >> 4, s) for x, s in zip(first, scales)],
                2: [value_bits(x & 15, s) for x, s in zip(second, scales)],
                3: [value_bits(x >> 4, s) for x, s in zip(second, scales)],
            }
            expected = [pair(*lane[0]), pair(*lane[2]), pair(*lane[1]), pair(*lane[3])]
            assert out == expected, (form, b, s_i, s_next, [hex(v) for v in out])


def test_the_emulator_reads_prmt_and_lop3_as_ptx_defines_them():
    """Known answers: prmt's byte picks and sign replication, lop3's truth table."""
    assert run_ptx("prmt.b32 $0, $1, $2, 0x3210;", [0, 0x44332211, 0x88776655])[0] == 0x44332211
    assert run_ptx("prmt.b32 $0, $1, $2, 0x7654;", [0, 0x44332211, 0x88776655])[0] == 0x88776655
    assert run_ptx("prmt.b32 $0, $1, 0, 0x8880;", [0, 0x000000F0])[0] == 0xFFFFFFF0
    assert run_ptx("lop3.b32 $0, $1, $2, $3, 0xE4;", [0, 0xAAAA, 0x5555, 0xFF00])[0] == 0xAA55


@pytest.mark.parametrize("lane", [0, 1, 17, 30, 31])
def test_the_lanemask_table_is_the_immediate_in_every_lane(lane):
    """%lanemask_lt & %lanemask_gt is 0 (lanes below and above a lane), so LUT_REG's table is
    0xC0804000 whatever the lane; the masks as PTX defines them for lane 5."""
    table = (
        "mov.b32 $1, %lanemask_lt; mov.b32 $2, %lanemask_gt; lop3.b32 $0, $1, $2, 0xC0804000, 0xEA;"
    )
    assert run_ptx(table, [0, 0, 0], lane=lane)[0] == 0xC0804000
    assert run_ptx("mov.b32 $0, %lanemask_lt; mov.b32 $1, %lanemask_gt;", [0, 0], lane=5) == [
        0x1F,
        0xFFFFFFC0,
    ]
