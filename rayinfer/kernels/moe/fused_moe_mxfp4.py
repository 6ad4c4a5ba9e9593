"""Routed experts with MXFP4 weights (W4A16), as DeepSeek-V4-Flash ships them, kept packed.

    w13 [E, 2I, H/2] uint8: gate rows then up rows; byte j of a row holds value 2j in its low
        nibble and 2j + 1 in its high nibble (e2m1: sign, 2 exponent bits, 1 mantissa bit)
    w13_scale [E, 2I, H/32] uint8: UE8M0 exponents, one per 32 values along K: 2^(e - 127)
    w2 [E, H, I/2] uint8 and w2_scale [E, H, I/32] uint8: the down projection, likewise
    weight[e, n, k] = E2M1[nibble(e, n, k)] * 2^(scale[e, n, k // 32] - 127)

(int8 or float4_e2m1fn_x2 weights and float8_e8m0fnu scales, as checkpoints store them, are
taken as their bytes.) The steps are those of the bf16 fused MoE (fused_moe.py): slots sorted
and padded per expert tile (moe_align), a gate+up grouped GEMM with SiLU into act [T*K, I] in
x's dtype, a down grouped GEMM weighted by the router into [T*K, H], the top-k sum. The GEMMs
read the packed bytes and dequantize in registers (fused_moe_mxfp4_kernel.py): a quarter of the
bf16 experts' bytes, plus one scale byte per 32 values. Three kernels, chosen by the tile's
SPLIT key: tl.dot_scaled (False); the split kernel (True: even and odd K as two dots over
de-interleaved activations, its bf16 dequantization in inline PTX with "ASM"; the default); the
four-lane word kernel (4: fused_moe_mxfp4_quad.py, a table lookup in PTX with "ASM"). On an H200
at V4-Flash shapes the default is 1.29x the bf16 fused MoE at 128 tokens and 0.77x at 4,096
(benchmarks/RESULTS.md, kernels): the upcast bounds it. The four-lane kernel issues 31% fewer
instructions per weight byte (docs/kernels.md) and is not yet timed on a GPU.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.moe.fused_moe import fused_moe_reference
from rayinfer.kernels.moe.fused_moe_kernels import _sum_topk_kernel
from rayinfer.kernels.moe.fused_moe_mxfp4_kernel import (
    MXFP4_GROUP,
    _moe_mxfp4_gemm_kernel,
    _moe_mxfp4_split_kernel,
)
from rayinfer.kernels.moe.fused_moe_mxfp4_quad import moe_mxfp4_quad_kernel
from rayinfer.kernels.moe.moe_align import moe_align
from rayinfer.kernels.tile_configs import pick_tile_config, tile_entry_names
from rayinfer.kernels.triton_compat import triton

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES)  # nibble 0..15 (bit 3: sign)
_BYTE_DTYPES = (torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
BF16 = torch.bfloat16
_SCALE_DTYPES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
# The four-lane kernel's table lookup on 16-row tiles: the fastest at 128 tokens on an H200
# (`bench kernels moe_mxfp4 --sweep`, 1.44x the split kernel there) and the fewest dequantizing
# instructions per byte on sm_80, sm_89 and sm_90 (benchmarks/compile_moe_kernels.py), so the
# default of GPUs without tiles of their own; configs/fused_moe_mxfp4.json has the larger tiles.
DEFAULT_TILE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4,
                "num_stages": 3, "SPLIT": 4, "ASM": True}  # fmt: skip
DEFAULT_CONFIG = {"w13": {**DEFAULT_TILE, "BLOCK_K": 128, "num_stages": 4}, "w2": DEFAULT_TILE}


def scales_fold(*scales: torch.Tensor) -> bool:
    """Whether every UE8M0 byte of these scale tensors is at most 128 (scales up to 2, as trained
    weights have): the four-lane kernel's lookup then multiplies each pair once (`small_scales`).
    Reads the tensors' maxima (a device sync on a GPU): call it once per set of weights."""
    return all(int(as_bytes(scale).max()) <= 128 for scale in scales)


def is_mxfp4(w13: torch.Tensor, w13_scale: torch.Tensor | None) -> bool:
    """Whether these experts are packed MXFP4: byte weights with byte (UE8M0) scales."""
    return w13.dtype in _BYTE_DTYPES and w13_scale is not None and w13_scale.dtype in _SCALE_DTYPES


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes as uint8, a view (int8, float4_e2m1fn_x2, float8_e8m0fnu)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def check_mxfp4_experts(x, w13, w2, w13_scale, w2_scale,
                        dtypes=(torch.bfloat16, torch.float16)) -> None:  # fmt: skip
    """ValueError naming the part and both shapes unless the experts fit x [T, H] of dtypes."""
    num_experts, two_i, packed_h = w13.shape
    hidden, inter = x.shape[-1], two_i // 2
    if hidden % MXFP4_GROUP or inter % MXFP4_GROUP:
        raise ValueError(f"MXFP4 experts need H={hidden} and I={inter} multiples of 32")
    want = {
        "w13": (num_experts, two_i, hidden // 2),
        "w13_scale": (num_experts, two_i, hidden // MXFP4_GROUP),
        "w2": (num_experts, hidden, inter // 2),
        "w2_scale": (num_experts, hidden, inter // MXFP4_GROUP),
    }
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(
                f"MXFP4 {name} {tuple(t.shape)}, expected {want[name]} for x [T, H={hidden}] "
                f"and w13 [E={num_experts}, 2I={two_i}, H/2]"
            )
        if not t.is_contiguous():
            raise ValueError(f"MXFP4 {name} must be contiguous")
    if x.dtype not in dtypes:
        raise ValueError(f"the MXFP4 kernel takes {dtypes} activations, not {x.dtype}")


def _pick_config(x, w13) -> dict:
    entries = tile_entry_names(x.device)
    num_experts, two_i, packed_h = w13.shape
    shape_key = f"E={num_experts},I={two_i // 2},H={2 * packed_h}"
    # configs/fused_moe_mxfp4.json: this shape's entry, else the GPU's "default", else ours
    return pick_tile_config("fused_moe_mxfp4", entries, shape_key, x.shape[0]) or DEFAULT_CONFIG


def lanes(tile: dict) -> int:
    """K lanes of a tile's kernel by its "SPLIT" key: 1 (absent or False: tl.dot_scaled), 2
    (True: the split kernel, even and odd k) or 4 (the quad-lane kernel, 16-bit words)."""
    split = tile.get("SPLIT") or 1
    split = 2 if split is True else split
    if split not in (1, 2, 4):
        raise ValueError(f'tile "SPLIT": {tile["SPLIT"]!r}; use False, True (2) or 4')
    return split


def swap_bit_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes with each byte's bits 2-3 and 4-5 swapped: (s e1 e0 m) of the high
    nibble and (s' e1' e0' m') of the low one become s e1 s' e1' e0 m e0' m', the order the
    four-lane lookup takes its table indices in (fused_moe_mxfp4_quad.py). Its own inverse."""
    b = as_bytes(packed)
    return (b & 0xC3) | ((b << 2) & 0x30) | ((b >> 2) & 0x0C)


def _kernel_and_params(tile: dict, dtype: torch.dtype, small_scales: bool,
                       bits_swapped: bool = False):  # fmt: skip
    """The tile's kernel and meta-parameters. "ASM" (bf16 only; fp16 takes the exact float32
    bits) is the split kernel's shift PTX and the four-lane kernel's table lookup; "LUT_REG"
    (four lanes only) that lookup with its table in a register. bits_swapped weights
    (`swap_bit_pairs`) only the four-lane kernel reads."""
    params = {key: value for key, value in tile.items() if key not in ("SPLIT", "ASM", "LUT_REG")}
    num_lanes = lanes(tile)
    if bits_swapped and num_lanes != 4:
        raise ValueError(f'experts with swapped bit pairs need four-lane tiles ("SPLIT": 4), '
                         f"not {tile}")  # fmt: skip
    if num_lanes == 1:
        return _moe_mxfp4_gemm_kernel, {**params, "FORMAT": "bf16" if dtype == BF16 else "fp16"}
    use_asm = bool(tile.get("ASM")) and dtype == BF16
    if num_lanes == 4:  # "LUT_REG": the lookup's table kept in a register (fewer instructions)
        lut_reg = bool(tile.get("LUT_REG"))
        return moe_mxfp4_quad_kernel, {**params, "USE_ASM": use_asm, "FOLD": small_scales,
                                       "LUT_REG": lut_reg, "SWAPPED": bits_swapped}  # fmt: skip
    return _moe_mxfp4_split_kernel, {**params, "USE_ASM": use_asm}


def _launch(a, w, scale, c, topk_weights, alignment, tile, top_k, is_w13, swiglu_limit,
            small_scales=False, bits_swapped=False):  # fmt: skip
    """One grouped GEMM: gate+up with SiLU (is_w13) or down weighted by the router. A tile of
    2 or 4 lanes takes a (and gives act) lane-major: [k = 0 mod L | 1 mod L | ..] (see
    `deinterleave`); 4 lanes read w as 16-bit words. small_scales: every scale byte is at most
    128, so the four-lane lookup multiplies each pair once. bits_swapped: w's bytes went
    through `swap_bit_pairs`."""
    n_out, k = c.shape[1], a.shape[1]
    kernel, params = _kernel_and_params(tile, a.dtype, bool(small_scales), bits_swapped)
    if lanes(tile) == 4:
        w = w.view(torch.int16)  # [E, N, K/4] words; strides in words
    num_pid_n = triton.cdiv(n_out, params["BLOCK_N"])
    num_blocks_m = alignment.block_expert_ids.numel()
    kernel[(num_blocks_m * num_pid_n,)](
        a, w, scale, c, topk_weights, *alignment,
        n_out, k, topk_weights.numel(), n_out, num_blocks_m,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), c.stride(0),
        SLOTS_PER_A_ROW=top_k if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
        EVEN_K=k % params["BLOCK_K"] == 0,
        USE_LIMIT=is_w13 and swiglu_limit is not None, LIMIT=float(swiglu_limit or 0.0),
        **params,
    )  # fmt: skip


def fused_moe_mxfp4(
    x: torch.Tensor,  # [T, H] bfloat16/float16
    w13: torch.Tensor,  # [E, 2I, H/2] packed e2m1 bytes: gate rows then up rows
    w2: torch.Tensor,  # [E, H, I/2] packed e2m1 bytes
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int: ids outside [0, E) are experts this rank does not hold
    w13_scale: torch.Tensor,  # [E, 2I, H/32] UE8M0 bytes
    w2_scale: torch.Tensor,  # [E, H, I/32] UE8M0 bytes
    config: dict | None = None,  # {"w13": tile, "w2": tile} with the same BLOCK_M
    *,
    swiglu_limit: float | None = None,  # DeepSeek-V4: silu(min(gate, l)) * clamp(up, -l, l)
    small_scales: bool = False,  # every scale byte <= 128 (scales <= 2, as trained weights have)
    bits_swapped: bool = False,  # w13 and w2 went through swap_bit_pairs (four-lane tiles only)
) -> torch.Tensor:  # [T, H] x.dtype
    check_mxfp4_experts(x, w13, w2, w13_scale, w2_scale)
    if x.stride(1) != 1 or topk_ids.shape != topk_weights.shape:
        raise ValueError("x needs contiguous rows; topk_ids and topk_weights must both be [T, K]")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if config is None:  # a GPU's tiles; swapped bit pairs need four lanes (the default's)
        config = _pick_config(x, w13)
        if bits_swapped and lanes(config["w13"]) != 4:
            config = DEFAULT_CONFIG
    w13_tile, w2_tile = config["w13"], config["w2"]
    if w13_tile["BLOCK_M"] != w2_tile["BLOCK_M"] or lanes(w13_tile) != lanes(w2_tile):
        raise ValueError("w13 and w2 tiles need the same BLOCK_M (one alignment) and SPLIT")
    alignment = moe_align(topk_ids, num_experts, config["w13"]["BLOCK_M"])
    weights = topk_weights.float().contiguous()
    act = torch.empty(num_tokens * top_k, two_i // 2, dtype=x.dtype, device=x.device)  # [T*K, I]
    slot_out = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    w13, w2, w13_scale, w2_scale = (as_bytes(t) for t in (w13, w2, w13_scale, w2_scale))
    x_in = deinterleave(x, lanes(w13_tile))
    _launch(x_in, w13, w13_scale, act, weights, alignment, w13_tile, top_k, True, swiglu_limit,
            small_scales, bits_swapped)  # fmt: skip
    _launch(act, w2, w2_scale, slot_out, weights, alignment, w2_tile, 1, False, None,
            small_scales, bits_swapped)  # fmt: skip
    hidden = x.shape[1]
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, 1024))](
        slot_out, topk_ids.contiguous(), out, hidden, num_experts, TOP_K=top_k, BLOCK_H=1024
    )
    return out


def deinterleave(x: torch.Tensor, num_lanes: int = 2) -> torch.Tensor:
    """[T, K] -> [T, K] lane-major: each row's k = 0 mod L values, then its 1 mod L ones, ..
    (a copy; x itself for one lane)."""
    if num_lanes == 1:
        return x
    return x.view(x.shape[0], -1, num_lanes).transpose(1, 2).reshape(x.shape)


def dequantize_mxfp4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] packed e2m1 with [..., N, K/32] UE8M0 scales -> [..., N, K] float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = as_bytes(packed).long()
    values = torch.stack([table[codes & 0xF], table[codes >> 4]], dim=-1).flatten(-2)
    exponents = as_bytes(scale).float() - 127.0
    return values * torch.exp2(exponents).repeat_interleave(MXFP4_GROUP, dim=-1)


def fused_moe_mxfp4_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                              swiglu_limit=None):  # fmt: skip
    """The experts dequantized to float32, through fused_moe_reference, in x's dtype out."""
    w13_full = dequantize_mxfp4_reference(w13, w13_scale)  # [E, 2I, H]
    w2_full = dequantize_mxfp4_reference(w2, w2_scale)  # [E, H, I]
    out = fused_moe_reference(x.float(), w13_full, w2_full, topk_weights, topk_ids, swiglu_limit)
    return out.to(x.dtype)
