"""MXFP4 routed experts with FP8 activations (W4A8), on GPUs with FP8 tensor cores (sm_89+).

The experts' bytes are rearranged once into octets (`to_octets`, same size: still 4 bits a
value, the UE8M0 scales unchanged), which fused_moe_mxfp4_w4a8_kernel.py makes exact e4m3 in
registers; activations are quantized per token and 128 channels as DeepSeek's FP8 layers do
(fp8_quant) and split into the kernel's two K lanes (`octet_lanes`). The steps are those of the
W4A16 path (fused_moe_mxfp4.py): slots sorted per expert tile, gate+up with SiLU into act,
act quantized, down weighted by the router, the top-k sum. Exact where each weight row's scales
lie within 11 binades of each other (`fits_w4a8`).
"""

from __future__ import annotations

import torch

from rayinfer.kernels.fp8.fp8_quant import fp8_quant
from rayinfer.kernels.moe.fused_moe_kernels import _sum_topk_kernel
from rayinfer.kernels.moe.fused_moe_mxfp4 import as_bytes, check_mxfp4_experts
from rayinfer.kernels.moe.fused_moe_mxfp4_w4a8_kernel import moe_mxfp4_w4a8_kernel
from rayinfer.kernels.moe.moe_align import moe_align
from rayinfer.kernels.triton_compat import triton

K_BLOCK = 128  # one weight scale block and one activation scale a K step
MAX_SCALE_SPREAD = 11  # binades between a row's largest and smallest scale (exact e4m3)
# Untimed tiles (no GPU has run this kernel yet) that build for sm_90 without spilling
# (benchmarks/compile_moe_kernels.py): 64 x 128 spills in the gate+up GEMM, whose two
# accumulators need twice the registers, so that stage takes 64 x 64.
DEFAULT_TILE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": K_BLOCK, "GROUP_M": 1, "num_warps": 4,
                "num_stages": 3}  # fmt: skip
_LARGE = {"BLOCK_M": 64, "BLOCK_K": K_BLOCK, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
LARGE_CONFIG = {"w13": {**_LARGE, "BLOCK_N": 64}, "w2": {**_LARGE, "BLOCK_N": 128}}
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # quantized to FP8 first
# the value whose sign each nibble of an octet word carries in its bit 3
_SIGN_OF_NIBBLE = (4, 0, 5, 1, 6, 2, 7, 3)
_NIBBLE_OF_SIGN = tuple(_SIGN_OF_NIBBLE.index(value) for value in range(8))


def to_octets(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes [..., K/2] as shipped (value 2j in byte j's low nibble) -> the kernel's
    octets, same shape: in each 4-byte word, nibble i holds v_i's magnitude in bits 0-2 and in
    bit 3 the sign of v_{4 + i/2} (even i) or v_{(i-1)/2} (odd i)."""
    return _move_signs(packed, _SIGN_OF_NIBBLE)


def from_octets(octets: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_octets`: the bytes as shipped."""
    return _move_signs(octets, _NIBBLE_OF_SIGN)


def _move_signs(packed: torch.Tensor, source: tuple[int, ...]) -> torch.Tensor:
    """Each 4-byte word's nibble i with its magnitude bits kept and its sign bit taken from
    nibble source[i]."""
    b = as_bytes(packed)
    if b.shape[-1] % 4:
        raise ValueError(f"octets need K/2 = {b.shape[-1]} bytes a multiple of 4")
    words = b.reshape(*b.shape[:-1], -1, 4).to(torch.int16)
    nibbles = torch.stack([words & 15, words >> 4], dim=-1).flatten(-2)  # [..., K/8, 8]
    moved = (nibbles & 7) | ((nibbles >> 3)[..., list(source)] << 3)
    return (moved[..., 0::2] | (moved[..., 1::2] << 4)).to(torch.uint8).reshape(b.shape)


def octet_lanes(q: torch.Tensor) -> torch.Tensor:
    """[rows, K] -> [rows, 2, K/2] (a copy): lane 0 the k mod 8 < 4 values, lane 1 the rest."""
    rows, k = q.shape
    return q.view(rows, k // 8, 2, 4).transpose(1, 2).reshape(rows, 2, k // 2)


def fits_w4a8(*scales: torch.Tensor) -> bool:
    """Whether every row of these UE8M0 scale tensors [.., N, K/32] spans at most 11 binades,
    so each of its values is an exact e4m3 number times the row's scale (reads the tensors: a
    device sync on a GPU; call once per set of weights)."""
    for scale in scales:
        s = as_bytes(scale)
        if s.shape[-1] % (K_BLOCK // 32):
            return False
        spread = s.amax(dim=-1).to(torch.int16) - s.amin(dim=-1).to(torch.int16)
        if spread.numel() and int(spread.max()) > MAX_SCALE_SPREAD:
            return False
    return True


def _launch(a_lanes, a_scale, w, scale, c, topk_weights, alignment, tile, top_k, is_w13,
            swiglu_limit, exact_bits):  # fmt: skip
    params = dict(tile)
    n_out, k = c.shape[1], a_lanes.shape[1] * a_lanes.shape[2]
    num_blocks_m = alignment.block_expert_ids.numel()
    # the interpreter runs CPU tensors and no PTX: the same bytes by integer arithmetic there
    use_asm = a_lanes.is_cuda and not exact_bits
    moe_mxfp4_w4a8_kernel[(num_blocks_m * triton.cdiv(n_out, params["BLOCK_N"]),)](
        a_lanes, a_scale, w, scale, c, topk_weights, *alignment,
        n_out, k, topk_weights.numel(), n_out, num_blocks_m,
        a_lanes.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), scale.stride(0),
        scale.stride(1), c.stride(0),
        SLOTS_PER_A_ROW=top_k if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
        USE_ASM=use_asm, USE_LIMIT=is_w13 and swiglu_limit is not None,
        LIMIT=float(swiglu_limit or 0.0), GROUPS=triton.next_power_of_2(k // 32), **params,
    )  # fmt: skip


def _quantized_lanes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = fp8_quant(x, K_BLOCK)
    return octet_lanes(q), scale


def fused_moe_mxfp4_w4a8(
    x: torch.Tensor,  # [T, H] bfloat16/float16/float32
    w13: torch.Tensor,  # [E, 2I, H/2] octets (to_octets): gate rows then up rows
    w2: torch.Tensor,  # [E, H, I/2] octets
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int: ids outside [0, E) are experts this rank does not hold
    w13_scale: torch.Tensor,  # [E, 2I, H/32] UE8M0 bytes
    w2_scale: torch.Tensor,  # [E, H, I/32] UE8M0 bytes
    config: dict | None = None,  # {"w13": tile, "w2": tile} with the same BLOCK_M, BLOCK_K 128
    *,
    swiglu_limit: float | None = None,
    exact_bits: bool = False,  # e4m3 bytes by integer arithmetic, not the PTX lookup (tests)
) -> torch.Tensor:  # [T, H] x.dtype
    check_mxfp4_experts(x, w13, w2, w13_scale, w2_scale, ACTIVATION_DTYPES)
    hidden, inter = x.shape[1], w13.shape[1] // 2
    if hidden % K_BLOCK or inter % K_BLOCK:
        raise ValueError(f"W4A8 MXFP4 experts need H={hidden} and I={inter} multiples of 128")
    if x.stride(1) != 1 or topk_ids.shape != topk_weights.shape:
        raise ValueError("x needs contiguous rows; topk_ids and topk_weights must both be [T, K]")
    num_tokens, top_k = topk_ids.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if config is None:  # 16-row tiles while experts get about 8 slots or fewer
        small = num_tokens * top_k <= 8 * w13.shape[0]
        config = {"w13": DEFAULT_TILE, "w2": DEFAULT_TILE} if small else LARGE_CONFIG
    if config["w13"]["BLOCK_M"] != config["w2"]["BLOCK_M"]:
        raise ValueError("w13 and w2 tiles need the same BLOCK_M (one alignment)")
    alignment = moe_align(topk_ids, w13.shape[0], config["w13"]["BLOCK_M"])
    weights = topk_weights.float().contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    w13, w2, w13_scale, w2_scale = (as_bytes(t) for t in (w13, w2, w13_scale, w2_scale))
    x_lanes, x_scale = _quantized_lanes(x)
    _launch(x_lanes, x_scale, w13, w13_scale, act, weights, alignment, config["w13"], top_k,
            True, swiglu_limit, exact_bits)  # fmt: skip
    act_lanes, act_scale = _quantized_lanes(act)
    _launch(act_lanes, act_scale, w2, w2_scale, slot_out, weights, alignment, config["w2"], 1,
            False, None, exact_bits)  # fmt: skip
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, 1024))](
        slot_out, topk_ids.contiguous(), out, hidden, w13.shape[0], TOP_K=top_k, BLOCK_H=1024
    )
    return out
