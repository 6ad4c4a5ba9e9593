"""W8A8 FP8 GEMM with DeepSeek-V3 block scales: out = (a * a_scale) @ (b * b_scale).T.

a [M, K] float8_e4m3fn with a_scale [M, K/128] (per token, per 128 channels, from fp8_quant);
b [N, K] float8_e4m3fn with b_scale [N/128, K/128] (one per 128x128 weight block, the checkpoint's
`weight_scale_inv`). Each K step of 128 multiplies in FP8 on the tensor cores and rescales the
partial product in float32 before adding it to the accumulator.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.tile_configs import pick_tile_config
from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import TensorDescriptor, tl, triton

SCALE_BLOCK = 128
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
                  "num_warps": 4, "num_stages": 3}  # fmt: skip


@triton.jit
def _k_block_scales(
    a_scale_ptrs, b_scale_ptr, b_scale_ptrs, k_step, num_scale_cols, stride_ask,
    SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Scales of one K block: ([BM] per row, [BN] per column or one scalar for the whole tile).

    Past the last K block (the odd half of an unrolled pair) both are 0, so it adds nothing.
    """
    scale_col = k_step * BLOCK_K // SCALE_BLOCK
    in_k = scale_col < num_scale_cols
    scale_col = tl.minimum(scale_col, num_scale_cols - 1)  # in bounds; zeroed below when past K
    a_scale = tl.load(a_scale_ptrs + scale_col * stride_ask)  # [BM]
    a_scale = tl.where(in_k, a_scale, 0.0)
    if SCALE_BLOCK % BLOCK_N == 0:  # the tile sits inside one 128-row weight block
        b_scale = tl.load(b_scale_ptr + scale_col)  # scalar
    else:
        b_scale = tl.load(b_scale_ptrs + scale_col)[None, :]  # [1, BN]
    return a_scale, b_scale


@triton.jit
def _add_scaled(acc, product, a_scale, b_scale):
    """acc [BM, BN] += product * a_scale[row] * b_scale (one FMA per element for a scalar b)."""
    return acc + product * (a_scale[:, None] * b_scale)


@triton.jit
def _load_k_block(a_ptrs, b_ptrs, k_step, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """a [BM, BK] and b [BK, BN] of K block k_step; zeros past K (also for a whole odd block)."""
    if EVEN_K:
        a = tl.load(a_ptrs + k_step * BLOCK_K)
        b = tl.load(b_ptrs + k_step * BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        k_left = K - k_step * BLOCK_K
        a = tl.load(a_ptrs + k_step * BLOCK_K, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs + k_step * BLOCK_K, mask=offs_k[:, None] < k_left, other=0.0)
    return a, b


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn,
    SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, K_UNROLL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c = a @ b.T with block scales. With K_UNROLL 2, an iteration issues the dots of two K
    blocks before scaling either, so one tensor-core product runs while the other is rescaled."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped rows: loads need no mask
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm  # [BM]
    b_scale_ptrs = b_scale_ptr + (offs_n // SCALE_BLOCK) * stride_bsn  # [BN]
    b_tile_scale_ptr = b_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn
    num_scale_cols = tl.cdiv(K, SCALE_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first_step in range(0, tl.cdiv(K, BLOCK_K), K_UNROLL):
        a, b = _load_k_block(a_ptrs, b_ptrs, first_step, K, EVEN_K, BLOCK_K)
        a_s, b_s = _k_block_scales(
            a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step, num_scale_cols, stride_ask,
            SCALE_BLOCK, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        product = tl.dot(a, b)
        if K_UNROLL == 2:
            a2, b2 = _load_k_block(a_ptrs, b_ptrs, first_step + 1, K, EVEN_K, BLOCK_K)
            a2_s, b2_s = _k_block_scales(
                a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step + 1, num_scale_cols,
                stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            product2 = tl.dot(a2, b2)
            acc = _add_scaled(acc, product, a_s, b_s)
            acc = _add_scaled(acc, product2, a2_s, b2_s)
        else:
            acc = _add_scaled(acc, product, a_s, b_s)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _fp8_block_gemm_tma_kernel(
    a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_asm, stride_ask, stride_bsn,
    SCALE_BLOCK: tl.constexpr, K_UNROLL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The same product with tiles moved by the TMA engine (K % 16 == 0; edges zero-padded)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm  # [BM]
    b_scale_ptrs = b_scale_ptr + (offs_n // SCALE_BLOCK) * stride_bsn  # [BN]
    b_tile_scale_ptr = b_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn
    num_scale_cols = tl.cdiv(K, SCALE_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first_step in range(0, tl.cdiv(K, BLOCK_K), K_UNROLL):
        a = a_desc.load([pid_m * BLOCK_M, first_step * BLOCK_K])  # [BM, BK]
        b = b_desc.load([pid_n * BLOCK_N, first_step * BLOCK_K])  # [BN, BK]
        a_s, b_s = _k_block_scales(
            a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step, num_scale_cols, stride_ask,
            SCALE_BLOCK, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        product = tl.dot(a, b.T)
        if K_UNROLL == 2:  # past K the descriptor reads zeros and the scales are 0
            a2 = a_desc.load([pid_m * BLOCK_M, (first_step + 1) * BLOCK_K])
            b2 = b_desc.load([pid_n * BLOCK_N, (first_step + 1) * BLOCK_K])
            a2_s, b2_s = _k_block_scales(
                a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step + 1, num_scale_cols,
                stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            product2 = tl.dot(a2, b2.T)
            acc = _add_scaled(acc, product, a_s, b_s)
            acc = _add_scaled(acc, product2, a2_s, b2_s)
        else:
            acc = _add_scaled(acc, product, a_s, b_s)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def _is_tma_compatible(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def _check_operands(a, a_scale, b, b_scale):
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] disagree: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b need contiguous rows (K innermost); call .contiguous()")
    (m, k), n = a.shape, b.shape[0]
    want_a = (m, triton.cdiv(k, SCALE_BLOCK))
    want_b = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK))
    if tuple(a_scale.shape) != want_a or tuple(b_scale.shape) != want_b:
        raise ValueError(
            f"a_scale {tuple(a_scale.shape)} / b_scale {tuple(b_scale.shape)} must be {want_a} / "
            f"{want_b}: per token per {SCALE_BLOCK} channels, per {SCALE_BLOCK}x{SCALE_BLOCK} block"
        )
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError("a_scale and b_scale must be float32")


def fp8_gemm(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, K/128] float32, any strides (column-major loads coalesce)
    b: torch.Tensor,  # [N, K] float8_e4m3fn
    b_scale: torch.Tensor,  # [N/128, K/128] float32
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    _check_operands(a, a_scale, b, b_scale)
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    device_name = torch.cuda.get_device_name(a.device) if a.is_cuda else "cpu"
    config = config or pick_tile_config("fp8_gemm", device_name, f"N={n},K={k}", m)
    config = config or DEFAULT_CONFIG
    if SCALE_BLOCK % config["BLOCK_K"]:
        raise ValueError(f"BLOCK_K={config['BLOCK_K']} must divide the scale block {SCALE_BLOCK}")
    tiles = {key: value for key, value in config.items() if key not in ("USE_TMA", "K_UNROLL")}
    unroll = config.get("K_UNROLL", 1)  # 2: two K blocks per iteration (see the kernel)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"]),)
    b_scale = b_scale.contiguous()
    if config.get("USE_TMA") and _is_tma_compatible(a, b, out):
        _fp8_block_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(a, [tiles["BLOCK_M"], tiles["BLOCK_K"]]),
            TensorDescriptor.from_tensor(b, [tiles["BLOCK_N"], tiles["BLOCK_K"]]),
            TensorDescriptor.from_tensor(out, [tiles["BLOCK_M"], tiles["BLOCK_N"]]),
            a_scale, b_scale, m, n, k, *a_scale.stride(), b_scale.stride(0),
            SCALE_BLOCK=SCALE_BLOCK, K_UNROLL=unroll, **tiles,
        )  # fmt: skip
        return out
    _fp8_block_gemm_kernel[grid](
        a, b, out, a_scale, b_scale, m, n, k,
        a.stride(0), b.stride(0), out.stride(0), *a_scale.stride(), b_scale.stride(0),
        SCALE_BLOCK=SCALE_BLOCK, EVEN_K=k % (tiles["BLOCK_K"] * unroll) == 0, K_UNROLL=unroll,
        **tiles,
    )  # fmt: skip
    return out


def fp8_gemm_reference(a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    """Dequantize both operands to float32 and multiply."""
    a_full = a.float() * a_scale.repeat_interleave(SCALE_BLOCK, 1)[:, : a.shape[1]]  # [M, K]
    b_rows = b_scale.repeat_interleave(SCALE_BLOCK, 0)[: b.shape[0]]  # [N, K/128]
    b_full = b.float() * b_rows.repeat_interleave(SCALE_BLOCK, 1)[:, : b.shape[1]]  # [N, K]
    return (a_full @ b_full.t()).to(out_dtype)
