"""W8A8 FP8 GEMM with DeepSeek-V3 block scales: out = (a * a_scale) @ (b * b_scale).T.

a [M, K] float8_e4m3fn with a_scale [M, K/128] (per token, per 128 channels, from fp8_quant);
b [N, K] float8_e4m3fn with b_scale [N/128, K/128] (one per 128x128 weight block, the checkpoint's
`weight_scale_inv`). Each K step of 128 multiplies in FP8 on the tensor cores and rescales the
partial product in float32 before adding it to the accumulator.

Two implementations of the same product: the Triton kernels (in fp8_gemm_kernels, launched by
`fp8_gemm` here), and torch's own blockwise-scaled `torch._scaled_mm` (cuBLAS,
`fp8_gemm_scaled_mm`). `fp8_gemm_auto` (what `ops.fp8_gemm` calls on CUDA) picks one per call:
`fp8_gemm_backend` says which, from the call's backend triton|cublas|auto (auto: cuBLAS where a
tiny probe call of the same shape class ran and matched the reference, once per device and class;
Triton otherwise and on any error).
"""

from __future__ import annotations

import logging

import torch

from rayinfer.kernels.fp8.fp8_gemm_kernels import (
    _fp8_block_gemm_kernel,
    _fp8_block_gemm_persistent_kernel,
    _fp8_block_gemm_tma_kernel,
    _sum_splits_kernel,
)
from rayinfer.kernels.tile_configs import pick_tile_config, tile_entry_names
from rayinfer.kernels.triton_compat import TensorDescriptor, triton

SCALE_BLOCK = 128
TRITON, CUBLAS = "triton", "cublas-blockwise"
LAUNCH_KEYS = ("USE_TMA", "K_UNROLL", "PERSISTENT", "WARP_SPECIALIZE", "FLATTEN", "SPLIT_K")

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
                  "num_warps": 4, "num_stages": 3}  # fmt: skip


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


def _num_programs(device: torch.device, per_sm: int) -> int:
    """Programs of the persistent kernel: per_sm per SM (2 under the interpreter)."""
    if device.type != "cuda":
        return 2
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def fp8_gemm(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, K/128] float32, any strides (column-major loads coalesce)
    b: torch.Tensor,  # [N, K] float8_e4m3fn
    b_scale: torch.Tensor,  # [N/128, K/128] float32
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """The Triton kernels. Launch options of `config` besides the tiles (absent: off):
    USE_TMA (TMA descriptors where the operands allow), K_UNROLL (2: two K blocks per iteration),
    WARP_SPECIALIZE (TMA: the K loop as `tl.range(..., warp_specialize=True)`), PERSISTENT (TMA:
    that many programs per SM loop over the tiles), FLATTEN (persistent: one flattened loop nest),
    SPLIT_K (pointer kernel: K split over that many programs per tile, float32 partials summed
    by a second launch; for decode's few rows, where the tiles alone leave SMs idle).
    """
    _check_operands(a, a_scale, b, b_scale)
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    entries = tile_entry_names(a.device)
    config = config or pick_tile_config("fp8_gemm", entries, f"N={n},K={k}", m)
    config = config or DEFAULT_CONFIG
    if SCALE_BLOCK % config["BLOCK_K"]:
        raise ValueError(f"BLOCK_K={config['BLOCK_K']} must divide the scale block {SCALE_BLOCK}")
    tiles = {key: value for key, value in config.items() if key not in LAUNCH_KEYS}
    unroll = config.get("K_UNROLL", 1)  # 2: two K blocks per iteration (see the kernel)
    num_tiles = triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"])
    b_scale = b_scale.contiguous()
    split_k = int(config.get("SPLIT_K", 1))
    if split_k > 1:
        _split_k_gemm(a, a_scale, b, b_scale, out, tiles, unroll, split_k, num_tiles)
        return out
    if config.get("USE_TMA") and _is_tma_compatible(a, b, out):
        descriptors = (
            TensorDescriptor.from_tensor(a, [tiles["BLOCK_M"], tiles["BLOCK_K"]]),
            TensorDescriptor.from_tensor(b, [tiles["BLOCK_N"], tiles["BLOCK_K"]]),
            TensorDescriptor.from_tensor(out, [tiles["BLOCK_M"], tiles["BLOCK_N"]]),
        )
        args = (*descriptors, a_scale, b_scale, m, n, k, *a_scale.stride(), b_scale.stride(0))
        options = dict(SCALE_BLOCK=SCALE_BLOCK, K_UNROLL=unroll,
                       WARP_SPECIALIZE=bool(config.get("WARP_SPECIALIZE")), **tiles)  # fmt: skip
        if config.get("PERSISTENT"):
            programs = min(num_tiles, _num_programs(a.device, int(config["PERSISTENT"])))
            _fp8_block_gemm_persistent_kernel[(programs,)](
                *args, FLATTEN=bool(config.get("FLATTEN")), NUM_PROGRAMS=programs, **options
            )
        else:
            _fp8_block_gemm_tma_kernel[(num_tiles,)](*args, **options)
        return out
    _fp8_block_gemm_kernel[(num_tiles,)](
        a, b, out, a_scale, b_scale, m, n, k,
        a.stride(0), b.stride(0), out.stride(0), *a_scale.stride(), b_scale.stride(0),
        SCALE_BLOCK=SCALE_BLOCK, EVEN_K=k % (tiles["BLOCK_K"] * unroll) == 0, K_UNROLL=unroll,
        **tiles,
    )  # fmt: skip
    return out


def _split_k_gemm(a, a_scale, b, b_scale, out, tiles: dict, unroll: int, split_k: int,
                  num_tiles: int) -> None:  # fmt: skip
    """out = the product, K split over split_k programs per tile (pointer kernel), their float32
    partials [split_k, M, N] summed into out by _sum_splits_kernel."""
    (m, k), n = a.shape, b.shape[0]
    k_steps = triton.cdiv(k, tiles["BLOCK_K"])
    per_split = triton.cdiv(triton.cdiv(k_steps, split_k), unroll) * unroll  # whole unrolled pairs
    split_k = triton.cdiv(k_steps, per_split)  # no split without K blocks
    partials = torch.empty(split_k, m, n, dtype=torch.float32, device=a.device)
    _fp8_block_gemm_kernel[(num_tiles, split_k)](
        a, b, partials, a_scale, b_scale, m, n, k,
        a.stride(0), b.stride(0), n, *a_scale.stride(), b_scale.stride(0),
        SCALE_BLOCK=SCALE_BLOCK, EVEN_K=k % (tiles["BLOCK_K"] * unroll) == 0, K_UNROLL=unroll,
        SPLIT_K=split_k, STEPS_PER_SPLIT=per_split, **tiles,
    )  # fmt: skip
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](partials, out, m * n, SPLIT_K=split_k,
                                                      BLOCK=block)  # fmt: skip


def fp8_gemm_reference(a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    """Dequantize both operands to float32 and multiply."""
    a_full = a.float() * a_scale.repeat_interleave(SCALE_BLOCK, 1)[:, : a.shape[1]]  # [M, K]
    b_rows = b_scale.repeat_interleave(SCALE_BLOCK, 0)[: b.shape[0]]  # [N, K/128]
    b_full = b.float() * b_rows.repeat_interleave(SCALE_BLOCK, 1)[:, : b.shape[1]]  # [N, K]
    return (a_full @ b_full.t()).to(out_dtype)


# ---------------------------------------------------------------- torch's blockwise _scaled_mm


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def blockwise_scales(a_scale: torch.Tensor, b_scale: torch.Tensor):
    """(scale_a, scale_b) in the layouts `torch._scaled_mm` takes as 1x128 / 128x128 blockwise.

    scale_a [M, K/128] "outer-dim major": strides (1, M), what fp8_quant(column_major_scales=True)
    writes; any other layout is copied into it. scale_b [K/128, N/128] is the transposed view of
    the [N/128, K/128] weight scales whose rows are padded to 4 floats (16 bytes): a row-major
    tensor when K/128 % 4 == 0 (every DeepSeek-V3 shape), a padded copy otherwise.
    """
    m, k_blocks = a_scale.shape
    n_blocks = b_scale.shape[0]
    a_ok = (m <= 1 or a_scale.stride(0) == 1) and (k_blocks <= 1 or a_scale.stride(1) == m)
    if not a_ok:
        a_scale = a_scale.t().contiguous().t()
    row_stride = _round_up(k_blocks, 4)
    b_ok = (n_blocks <= 1 or b_scale.stride(0) == row_stride) and (
        k_blocks <= 1 or b_scale.stride(1) == 1
    )
    if not b_ok:
        padded = b_scale.new_zeros(n_blocks, row_stride)[:, :k_blocks]
        b_scale = padded.copy_(b_scale)
    return a_scale, b_scale.t()


def fp8_gemm_scaled_mm(a, a_scale, b, b_scale, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The same product through `torch._scaled_mm` with blockwise scales (cuBLAS on Hopper with
    CUDA >= 12.9); raises where this torch, GPU or shape has no such kernel."""
    _check_operands(a, a_scale, b, b_scale)
    if a.shape[0] == 0:
        return torch.empty(0, b.shape[0], dtype=out_dtype, device=a.device)
    scale_a, scale_b = blockwise_scales(a_scale, b_scale)
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


_PROBED: dict[tuple, bool] = {}  # shape class -> whether the blockwise _scaled_mm ran and matched
PROBE_MAX_REL_ERR = 2e-2  # bf16 output: ~4e-3; a misread scale layout gives O(1)


def _residue_class(size: int, period: int) -> int:
    """size itself up to 2 periods, else one period plus size % period: the probe's size."""
    return size if size <= 2 * period else period + size % period


def _shape_class(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> tuple:
    """(device, out dtype, probe M, N, K): sizes with the residues that alignment rules see."""
    (m, k), n = a.shape, b.shape[0]
    device = (a.device.type, a.device.index)
    return device, out_dtype, _residue_class(m, 16), _residue_class(n, 256), _residue_class(k, 512)


def probe_blockwise_scaled_mm(device, out_dtype, m: int, n: int, k: int) -> bool:
    """One tiny blockwise `_scaled_mm` of this shape class on `device`, checked against the
    float32 reference; False on any error or mismatch."""
    try:
        generator = torch.Generator(device=device).manual_seed(m * 7919 + n * 31 + k)
        a = torch.randn(m, k, device=device, generator=generator).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device, generator=generator).to(torch.float8_e4m3fn)
        k_blocks, n_blocks = triton.cdiv(k, SCALE_BLOCK), triton.cdiv(n, SCALE_BLOCK)
        a_scale = torch.rand(k_blocks, m, device=device, generator=generator).t() + 0.5
        b_scale = torch.rand(n_blocks, k_blocks, device=device, generator=generator) + 0.5
        out = fp8_gemm_scaled_mm(a, a_scale, b, b_scale, out_dtype).float()
        ref = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
        err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()  # syncs
        ok = out.shape == ref.shape and err <= PROBE_MAX_REL_ERR
        logger.info("fp8_gemm: blockwise _scaled_mm M=%d N=%d K=%d %s on %s: rel err %.2e",
                    m, n, k, out_dtype, device, err)  # fmt: skip
        return bool(ok)
    except Exception as error:  # no such kernel here: the Triton one serves this class
        logger.info("fp8_gemm: no blockwise _scaled_mm for M=%d N=%d K=%d %s on %s (%s: %s)",
                    m, n, k, out_dtype, device, type(error).__name__, str(error)[:200])  # fmt: skip
        return False


def _forced_backend(choice: str) -> str | None:
    if choice not in ("auto", "triton", "cublas"):
        raise ValueError(f"kernels.fp8_gemm={choice!r}; use one of auto, triton, cublas")
    return {"triton": TRITON, "cublas": CUBLAS}.get(choice)


def _can_probe(a: torch.Tensor) -> bool:
    """A CUDA tensor, a torch with _scaled_mm, and no CUDA graph being captured (a probe syncs)."""
    if not a.is_cuda or not hasattr(torch, "_scaled_mm"):
        return False
    return not torch.cuda.is_current_stream_capturing()


def fp8_gemm_backend(
    a: torch.Tensor, b: torch.Tensor, out_dtype=torch.bfloat16, backend: str = "auto"
) -> str:
    """The backend `fp8_gemm_auto` runs for these operands: "cublas-blockwise" or "triton".

    backend triton|cublas (KernelBackends.fp8_gemm) forces one; auto (the default) takes cuBLAS
    where the probe of this shape class passed (probed on first use; never while a CUDA graph is
    captured: Triton then, without caching the answer), Triton elsewhere.
    """
    forced = _forced_backend(backend)
    if forced:
        return forced
    key = _shape_class(a, b, out_dtype)
    supported = _PROBED.get(key)
    if supported is None:
        if not _can_probe(a):
            return TRITON
        supported = _PROBED[key] = probe_blockwise_scaled_mm(a.device, *key[1:])
    return CUBLAS if supported else TRITON


def fp8_gemm_auto(a, a_scale, b, b_scale, out_dtype=torch.bfloat16, backend: str = "auto"):
    """The product [M, N] through the kernel `fp8_gemm_backend` picks for `backend`. In auto
    mode an error of the cuBLAS call falls back to Triton and marks the shape class unsupported;
    a forced backend's errors are raised."""
    if fp8_gemm_backend(a, b, out_dtype, backend) == CUBLAS:
        if _forced_backend(backend):
            return fp8_gemm_scaled_mm(a, a_scale, b, b_scale, out_dtype)
        try:
            return fp8_gemm_scaled_mm(a, a_scale, b, b_scale, out_dtype)
        except Exception as error:
            _PROBED[_shape_class(a, b, out_dtype)] = False
            logger.warning("fp8_gemm: blockwise _scaled_mm failed for %s x %s (%s: %s); Triton "
                           "serves this shape class from now on", tuple(a.shape), tuple(b.shape),
                           type(error).__name__, str(error)[:200])  # fmt: skip
    return fp8_gemm(a, a_scale, b, b_scale, out_dtype)
