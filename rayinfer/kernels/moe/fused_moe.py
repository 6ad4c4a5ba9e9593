"""Routed experts: every token runs through its top-k experts' SwiGLU MLPs, weighted and summed.

The Triton path is a grouped GEMM over tokens sorted and padded per expert tile (moe_align):
  1. gate+up: act[slot] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   [T*K, I]
     (with swiglu_limit, DeepSeek-V4: gate clamped above, up both ways, before the product)
  2. down:    out_slot[slot] = topk_weight[slot] * act[slot] @ w2[e].T               [T*K, H]
  3. top-k reduction: out[t] = sum_k out_slot[t*K + k] over slots routed to a held expert.
FP8 weights (DeepSeek-V3: float8_e4m3fn with one float32 scale per 128x128 block) multiply
activations quantized per token and per 128 channels (fp8_quant) and rescale every K step.

Row tiles: by default a program multiplies one BLOCK_M tile of one expert's rows. A tile config
with TAIL_M instead pads each expert's rows to TAIL_M and gives a program a chunk of up to
BLOCK_M + TAIL_M of them (two accumulators): at ~1.5 tiles of rows per expert (4,096 V3 tokens,
~128 rows each), each weight tile is read once per K step and 192 rows are multiplied instead of
2 x 128. GATE_UP_ONE_DOT (w13, chunked) makes gate and up one [rows, BLOCK_N] product whose
columns are BLOCK_N/2 gate then BLOCK_N/2 up outputs, which keeps the accumulators in registers.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.elementwise.activation import silu_and_mul_reference
from rayinfer.kernels.fp8.fp8_quant import fp8_dequant_reference, fp8_quant, fp8_quant_reference
from rayinfer.kernels.moe.fused_moe_chunks import (
    ExpertChunks,
    _check_chunk_tile,
    expert_chunks,
    row_granule,
)
from rayinfer.kernels.moe.fused_moe_kernels import (
    QUANT_GROUP,
    _moe_chunk_gemm_kernel,
    _moe_gemm_kernel,
    _sum_topk_kernel,
)
from rayinfer.kernels.moe.moe_align import moe_align
from rayinfer.kernels.tile_configs import pick_tile_config, tile_entry_names
from rayinfer.kernels.triton_compat import TensorDescriptor, triton

SCALE_BLOCK = 128
# Tile keys that choose a code path rather than a kernel argument of the same name.
LAUNCH_OPTIONS = ("USE_TMA", "GATE_UP_ONE_DOT")
DEFAULT_CONFIG = {
    "w13": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 3},
    "w2": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
           "num_stages": 3},
}  # fmt: skip
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale):
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)} [T, H], w13 {tuple(w13.shape)} [E, 2I, H], "
            f"w2 {tuple(w2.shape)} [E, H, I]"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={x.shape[0]}, K]"
        )
    if x.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x needs contiguous rows and w13, w2 must be contiguous")
    is_fp8 = w13.dtype == torch.float8_e4m3fn
    if is_fp8 != (w13_scale is not None) or is_fp8 != (w2_scale is not None):
        raise ValueError("float8_e4m3fn w13/w2 need w13_scale and w2_scale, and only they do")
    if is_fp8:
        for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
            want = (num_experts, *(triton.cdiv(d, SCALE_BLOCK) for d in w.shape[1:]))
            if tuple(scale.shape) != want or scale.dtype != torch.float32:
                raise ValueError(f"{name}_scale must be float32 {want}, got {tuple(scale.shape)}")
    elif x.dtype != w13.dtype or w13.dtype != w2.dtype:
        raise ValueError(f"x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}")


def _pick_config(x, w13, num_slots):
    if x.dtype == torch.float32:
        # Tuned tiles are for 2-byte inputs; in float32 they need up to 288 KiB of shared memory
        # (H200 has 227 KiB). The default tiles fit: float32 is for parity checks, not speed.
        return DEFAULT_CONFIG
    entries = tile_entry_names(x.device)
    kind = "fp8" if w13.dtype == torch.float8_e4m3fn else "bf16"
    shape_key = f"{kind},E={w13.shape[0]},I={w13.shape[1] // 2},H={w13.shape[2]}"
    config = pick_tile_config("fused_moe", entries, shape_key, x.shape[0])
    if config is None:
        config = pick_tile_config("fused_moe", entries, kind, x.shape[0])
    return config or DEFAULT_CONFIG


def _is_one_dot(tile: dict, stage: str) -> bool:
    """Whether the stage's tile makes gate and up as one product (GATE_UP_ONE_DOT, chunked)."""
    return stage == "w13" and "TAIL_M" in tile and bool(tile.get("GATE_UP_ONE_DOT"))


def _output_columns(tile: dict, stage: str) -> int:
    """A program's output columns: BLOCK_N, or BLOCK_N / 2 with gate and up in one product."""
    return tile["BLOCK_N"] // 2 if _is_one_dot(tile, stage) else tile["BLOCK_N"]


def quantizes_in_epilogue(tile: dict, intermediate: int) -> bool:
    """Whether gate+up with this tile writes the FP8 experts' activations and their scales
    itself: each program's output columns are whole 128-channel groups and the tiles cover the
    intermediate size exactly."""
    out_n = _output_columns(tile, "w13")
    return out_n % QUANT_GROUP == 0 and intermediate % out_n == 0


def _launch_gemm(a, b, c, a_scale, b_scale, topk_weights, alignment, stage, config, top_k,
                 chunks: ExpertChunks | None = None, swiglu_limit: float | None = None,
                 c_scale: torch.Tensor | None = None,
                 act_dtype: torch.dtype | None = None):  # fmt: skip
    """One grouped GEMM; stage "w13" (gate+up with SiLU) or "w2" (down with top-k weights).

    A tile with TAIL_M runs one program per chunk of an expert's rows (alignment made with
    block_m = TAIL_M); chunks are built here when not given. With c_scale (gate+up, a tile
    that `quantizes_in_epilogue`), c is float8_e4m3fn: the activations as `fp8_quant` would
    make them from their act_dtype values, c_scale [T*K, I/128] their scales.
    """
    tile = {key: value for key, value in config[stage].items() if key not in LAUNCH_OPTIONS}
    is_w13 = stage == "w13"
    n_out, k = c.shape[1], a.shape[1]
    use_fp8 = b_scale is not None
    if use_fp8 and SCALE_BLOCK % tile["BLOCK_K"]:  # a K step reads one block's scales
        raise ValueError(f"config {stage}: BLOCK_K={tile['BLOCK_K']} must divide the FP8 scale "
                         f"block ({SCALE_BLOCK})")  # fmt: skip
    use_tma = bool(config[stage].get("USE_TMA")) and k * b.element_size() % 16 == 0
    one_dot = _is_one_dot(config[stage], stage)
    weights = b
    if use_tma and one_dot:  # w13 as [E, 2, I, H]: a box holds BN/2 gate and BN/2 up rows
        box = [1, 2, tile["BLOCK_N"] // 2, tile["BLOCK_K"]]
        weights = TensorDescriptor.from_tensor(b.view(b.shape[0], 2, n_out, k), box)
    elif use_tma:  # the experts' rows as one [E*N, K] matrix, read in [BN, BK] boxes
        box = [tile["BLOCK_N"], tile["BLOCK_K"]]
        weights = TensorDescriptor.from_tensor(b.view(-1, k), box)
    common = dict(
        SLOTS_PER_A_ROW=top_k if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
        USE_FP8=use_fp8, SCALE_BLOCK=SCALE_BLOCK, EVEN_K=k % tile["BLOCK_K"] == 0,
        USE_TMA=use_tma, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **tile,
    )  # fmt: skip
    if swiglu_limit is not None:  # a constexpr: the default path compiles as before
        common.update(USE_LIMIT=True, LIMIT=float(swiglu_limit))
    if c_scale is not None:  # constexprs: the default path compiles as before
        if not (is_w13 and quantizes_in_epilogue(config[stage], n_out)):
            raise ValueError(f"config {stage}: {config[stage]} cannot quantize its output")
        common.update(QUANT_OUT=True, ACT_DTYPE=DTYPE_NAMES[act_dtype])
    operands = (
        a, weights, c, c if c_scale is None else c_scale, a_scale if use_fp8 else a,
        b_scale if use_fp8 else b, topk_weights,
    )  # fmt: skip
    strides = (
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        0 if c_scale is None else c_scale.stride(0), a_scale.stride(0) if use_fp8 else 0,
        b_scale.stride(0) if use_fp8 else 0, b_scale.stride(1) if use_fp8 else 0,
    )  # fmt: skip
    num_pid_n = triton.cdiv(n_out, _output_columns(config[stage], stage))
    if "TAIL_M" in tile:
        _check_chunk_tile(tile)
        if chunks is None:
            chunks = expert_chunks(alignment, topk_weights.numel(), b.shape[0], tile)
        for with_tail in (False, True):  # two launches: one K loop per kernel
            row, max_chunks = int(with_tail), chunks.max_chunks[int(with_tail)]
            if max_chunks == 0:
                continue
            _moe_chunk_gemm_kernel[(max_chunks * num_pid_n,)](
                *operands, alignment.sorted_slot_ids, alignment.block_expert_ids,
                chunks.first_tile[row], chunks.num_tiles[row], chunks.num_chunks[row:],
                n_out, k, topk_weights.numel(), n_out, max_chunks, *strides,
                GATE_UP_ONE_DOT=one_dot, WITH_TAIL=with_tail, **common,
            )  # fmt: skip
        return
    num_blocks_m = alignment.block_expert_ids.numel()
    # one weight scale per tile and K step: BN divides the scale block, and the up rows (from
    # up_offset = n_out) start on a block boundary
    one_b_scale = use_fp8 and SCALE_BLOCK % tile["BLOCK_N"] == 0
    one_b_scale = one_b_scale and (not is_w13 or n_out % SCALE_BLOCK == 0)
    _moe_gemm_kernel[(num_blocks_m * num_pid_n,)](
        *operands, *alignment, n_out, k, topk_weights.numel(), n_out, num_blocks_m, *strides,
        ONE_B_SCALE=one_b_scale, **common,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, H] bfloat16/float16/float32
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows; x.dtype or float8_e4m3fn
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int: ids outside [0, E) are experts this rank does not hold
    w13_scale: torch.Tensor | None = None,  # [E, 2I/128, H/128] float32 for FP8 weights
    w2_scale: torch.Tensor | None = None,  # [E, H/128, I/128] float32 for FP8 weights
    config: dict | None = None,  # {"w13": tile, "w2": tile}; same TAIL_M or BLOCK_M in both
    *,
    swiglu_limit: float | None = None,  # DeepSeek-V4: silu(min(gate, l)) * clamp(up, -l, l)
) -> torch.Tensor:  # [T, H] x.dtype
    _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    config = config or _pick_config(x, w13, num_tokens * top_k)
    alignment = moe_align(topk_ids, num_experts, row_granule(config))
    chunks = None
    if "TAIL_M" in config["w13"]:  # one program per chunk of an expert's rows, in both GEMMs
        _check_chunk_tile(config["w13"])
        chunks = expert_chunks(alignment, num_tokens * top_k, num_experts, config["w13"])
    weights = topk_weights.float().contiguous()
    num_slots, intermediate = num_tokens * top_k, two_i // 2
    # FP8 experts: gate+up quantizes the activations itself where its tile allows, else a pass
    # of fp8_quant after it does (the same bytes and scales either way).
    fused_quant = w2_scale is not None and quantizes_in_epilogue(config["w13"], intermediate)
    act_stored_as = torch.float8_e4m3fn if fused_quant else x.dtype
    act = torch.empty(num_slots, intermediate, dtype=act_stored_as, device=x.device)  # [T*K, I]
    act_scale = None
    if fused_quant:
        act_scale = torch.empty(num_slots, intermediate // QUANT_GROUP, device=x.device)
    slot_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)  # [T*K, H]
    x_in, x_scale = fp8_quant(x) if w13_scale is not None else (x, None)
    stage_args = (weights, alignment)
    _launch_gemm(x_in, w13, act, x_scale, w13_scale, *stage_args, "w13", config, top_k, chunks,
                 swiglu_limit, act_scale, x.dtype)  # fmt: skip
    act_in = act
    if w2_scale is not None and not fused_quant:
        act_in, act_scale = fp8_quant(act)
    w2_chunks = chunks if config["w2"].get("BLOCK_M") == config["w13"]["BLOCK_M"] else None
    _launch_gemm(act_in, w2, slot_out, act_scale, w2_scale, *stage_args, "w2", config, 1, w2_chunks)
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, 1024))](
        slot_out, topk_ids.contiguous(), out, hidden, num_experts, TOP_K=top_k, BLOCK_H=1024
    )
    return out


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows of each expert
    w2: torch.Tensor,  # [E, H, I]: down projection of each expert
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64: expert of each (token, slot); E_local ids
    swiglu_limit: float | None = None,  # clamp gate above and up both ways before the product
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    # Slots routed to an expert this rank does not hold (id < 0 or >= E) sort last and are dropped.
    held = (flat_ids >= 0) & (flat_ids < num_experts)  # [T*K]
    order = torch.where(held, flat_ids, num_experts).argsort(stable=True)[: int(held.sum())]
    counts = torch.bincount(flat_ids[order], minlength=num_experts).tolist()  # [E]
    tokens = order // top_k  # [S] token of each held slot, grouped by expert
    slot_out = torch.empty(order.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate_up = x[tokens[rows]] @ w13[expert].t()  # [n, 2I]
            hidden = silu_and_mul_reference(gate_up, swiglu_limit)  # [n, I]
            slot_out[rows] = (hidden @ w2[expert].t()).float()  # [n, H]
            start += count
    weights = topk_weights.reshape(-1)[order].float()  # [S]
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, tokens, slot_out * weights[:, None])
    return out.to(x.dtype)


def dequantize_experts_reference(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K] float8_e4m3fn with [E, N/128, K/128] block scales -> [E, N, K] float32."""
    rows = scale.repeat_interleave(SCALE_BLOCK, 1)[:, : w.shape[1]]  # [E, N, K/128]
    return w.float() * rows.repeat_interleave(SCALE_BLOCK, 2)[:, :, : w.shape[2]]


def fused_moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                            swiglu_limit=None):  # fmt: skip
    """The FP8 path in float32: activations quantized per token per 128 channels like the kernel."""
    x_q = fp8_dequant_reference(*fp8_quant_reference(x))  # [T, H] float32
    w13_full = dequantize_experts_reference(w13, w13_scale)  # [E, 2I, H]
    w2_full = dequantize_experts_reference(w2, w2_scale)  # [E, H, I]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for expert, weight in zip(ids, weights):
            if 0 <= expert < w13.shape[0]:
                gate_up = x_q[token : token + 1] @ w13_full[expert].t()  # [1, 2I]
                act = silu_and_mul_reference(gate_up, swiglu_limit)
                act = fp8_dequant_reference(*fp8_quant_reference(act))  # [1, I]
                out[token] += weight * (act @ w2_full[expert].t())[0]
    return out.to(x.dtype)
