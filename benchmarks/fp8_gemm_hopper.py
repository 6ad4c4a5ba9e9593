"""W8A8 FP8 GEMM with DeepSeek-V3 block scales for Hopper (sm_90), warp-specialized in Gluon.

out [M, N] = (a * a_scale) @ (b * b_scale).T, the contract of fp8_gemm.fp8_gemm: a [M, K] e4m3
with a_scale [M, K/128] (per token, per 128 channels), b [N, K] e4m3 with b_scale [N/128, K/128].

The Triton kernels stop at 0.65-0.75x of per-tensor `_scaled_mm` and cuBLAS's block-scaled
kernel at 0.86-0.96x (benchmarks/RESULTS.md, kernels). Here, as in DeepGEMM, each K block's
product runs on the tensor cores into a scratch accumulator that the consumer then scales into
its own (`acc += product * a_scale[row] * b_scale`), and the roles are split:
- a producer warp streams A and B tiles of one 128-wide K block by TMA into a ring of STAGES
  slots (mbarriers "ready" and "empty");
- three consumer warpgroups own 64 rows each of the program's 192 x BLOCK_N output tile; while
  one scales a finished product into its accumulator, the others' products run.
The epilogue goes through shared memory and a TMA store (rows and columns past M and N are
dropped by TMA). One program per output tile, grouped along M for L2 reuse of B.

Status: correct on the H200 and 0.66-0.73x of per-tensor `_scaled_mm` at M = 4,096, below
cuBLAS's block-scaled kernel (0.84-0.89x in the same run), so `ops.fp8_gemm` does not route here
(`benchmarks/gluon_fp8_gemm.py`; each consumer's chain of product, wait and scale is
latency-bound). It is kept, compile-tested in CI (`benchmarks/ttgir_probe.py fp8-ws`), as the base
for a faster form.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.gluon_compat import (
    HAS_GLUON,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    rows_descriptor,
    tma,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from rayinfer.kernels.triton_compat import triton

SCALE_BLOCK = 128  # = BLOCK_K: one scale per 128 channels of a, per 128x128 block of b
CONSUMERS = 3  # warpgroups, HALF_M rows each: three chains of product-then-scale per SM
HALF_M = 64
BLOCK_M = CONSUMERS * HALF_M
BLOCK_N = 128  # inside one 128-row weight-scale block: b's scale is one number per K block
GROUP_M = 8
# Launched at 120 registers x 16 warps; the consumers grow to 152 and the producer shrinks to 24.
LAUNCH_REGISTERS = 120
CONSUMER_REGISTERS = 152
PRODUCER_REGISTERS = 24

if HAS_GLUON:
    STAGES = gl.constexpr(4)  # 4 x (3 x 8 + 16) KiB of A/B slots, plus 48 KiB for the epilogue
    CONSUMERS_C = gl.constexpr(CONSUMERS)
    CONSUMER_REGISTERS_C = gl.constexpr(CONSUMER_REGISTERS)
    PRODUCER_REGISTERS_C = gl.constexpr(PRODUCER_REGISTERS)

    @gluon.jit
    def _producer(ctx, WG: gl.constexpr):
        """One warp: A's 64-row parts and B of every K block into the ring."""
        descs, smem, bars, scales, offs, k_blocks = ctx
        a_desc, b_desc, c_desc = descs
        a_smem, b_smem, c_smem = smem
        ready, empty = bars
        off_m, off_n = offs
        half: gl.constexpr = a_desc.block_type.shape[0]
        block_k: gl.constexpr = a_desc.block_type.shape[1]
        nbytes: gl.constexpr = CONSUMERS_C * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        for i in range(k_blocks):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # fresh: phase 1 done
            mbarrier.expect(ready.index(slot), nbytes)
            k = i * block_k
            for part in gl.static_range(CONSUMERS_C):
                tma_load(a_desc, [off_m + part * half, k], ready.index(slot),
                         a_smem.index(CONSUMERS_C * slot + part))  # fmt: skip
            tma_load(b_desc, [off_n, k], ready.index(slot), b_smem.index(slot))

    @gluon.jit
    def _block_scale(a_scale_ptrs, stride_ak, b_scale_ptr, in_m, block, k_blocks):
        """a_scale[row, block] * b_scale[n block, block] for the consumer's 64 rows ([64]; zeros
        past the last K block)."""
        in_k = block < k_blocks
        a_scale = gl.load(a_scale_ptrs + block * stride_ak, mask=in_m & in_k, other=0.0)
        return a_scale * gl.load(b_scale_ptr + block, mask=in_k, other=0.0)

    @gluon.jit
    def _consumer(ctx, WG: gl.constexpr):
        """A warpgroup: rows WG*64.. of the output tile, over every K block."""
        descs, smem, bars, scales, offs, k_blocks = ctx
        a_desc, b_desc, c_desc = descs
        a_smem, b_smem, c_smem = smem
        ready, empty = bars
        a_scale_ptr, stride_am, stride_ak, b_scale_ptr, stride_bn, m = scales
        off_m, off_n = offs
        half: gl.constexpr = a_desc.block_type.shape[0]
        block_n: gl.constexpr = b_desc.block_type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 32]
        )
        rows = off_m + WG * half + gl.arange(0, half, layout=gl.SliceLayout(1, layout))  # [64]
        a_scale_ptrs = a_scale_ptr + rows.to(gl.int64) * stride_am
        in_m = rows < m
        b_scale_ptr = b_scale_ptr + (off_n // block_n) * stride_bn
        zero = gl.zeros([half, block_n], gl.float32, layout=layout)
        acc = gl.zeros([half, block_n], gl.float32, layout=layout)

        # Scales are loaded two K blocks ahead of their use: a global load's latency would
        # otherwise stall every block (measured: 0.8 us per 128-wide block at M = 4,096).
        scale = _block_scale(a_scale_ptrs, stride_ak, b_scale_ptr, in_m, 0, k_blocks)
        scale_next = _block_scale(a_scale_ptrs, stride_ak, b_scale_ptr, in_m, 1, k_blocks)
        for i in range(k_blocks):
            scale_after = _block_scale(a_scale_ptrs, stride_ak, b_scale_ptr, in_m, i + 2,
                                       k_blocks)  # fmt: skip
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            product = warpgroup_mma(a_smem.index(CONSUMERS_C * slot + WG),
                                    b_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)  # fmt: skip
            # Waited at once: the other consumer's product keeps the tensor cores busy while
            # this one scales (a product left in flight across the loop's back edge made ptxas
            # serialize every wgmma, C7514).
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
            mbarrier.arrive(empty.index(slot), count=1)
            acc += product * scale[:, None]
            scale = scale_next
            scale_next = scale_after

        out = c_smem.index(WG)
        out.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [off_m + WG * half, off_n], out)
        tma.store_wait(0)

    @gluon.jit
    def _fp8_gemm_ws_kernel(a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr, m, n, k,
                            stride_am, stride_ak, stride_bn, GROUP: gl.constexpr):  # fmt: skip
        half: gl.constexpr = a_desc.block_type.shape[0]
        block_k: gl.constexpr = a_desc.block_type.shape[1]
        block_n: gl.constexpr = b_desc.block_type.shape[0]
        # Tiles grouped along M: GROUP row tiles share each column tile's B while it is in L2.
        pid = gl.program_id(0)
        tiles_m = gl.cdiv(m, CONSUMERS_C * half)
        tiles_n = gl.cdiv(n, block_n)
        in_group = GROUP * tiles_n
        first_m = (pid // in_group) * GROUP
        group_rows = gl.minimum(tiles_m - first_m, GROUP)
        tile_m = first_m + (pid % in_group) % group_rows
        tile_n = (pid % in_group) // group_rows
        offs = (tile_m * CONSUMERS_C * half, tile_n * block_n)

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [CONSUMERS_C * STAGES, half, block_k],
                                           a_desc.layout)  # fmt: skip
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, block_n, block_k],
                                           b_desc.layout)  # fmt: skip
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS_C, half, block_n],
                                           c_desc.layout)  # fmt: skip
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS_C)  # every consumer releases a slot

        ctx = (
            (a_desc, b_desc, c_desc),
            (a_smem, b_smem, c_smem),
            (ready, empty),
            (a_scale_ptr, stride_am, stride_ak, b_scale_ptr, stride_bn, m),
            offs,
            gl.cdiv(k, block_k),
        )
        gl.warp_specialize(
            [(_consumer, (ctx, 0)), (_consumer, (ctx, 1)), (_consumer, (ctx, 2)),
             (_producer, (ctx, 3))],
            [4, 4, 1],
            [CONSUMER_REGISTERS_C, CONSUMER_REGISTERS_C, PRODUCER_REGISTERS_C],
        )  # fmt: skip


def supports(a: torch.Tensor, b: torch.Tensor, out_dtype=torch.bfloat16) -> bool:
    """Whether this kernel serves these operands: Hopper (sm_90 exactly), e4m3 a [M, K] and
    b [N, K] with 16-byte aligned rows, K a multiple of 128, bf16 output with N a multiple of 8."""
    if not HAS_GLUON or not a.is_cuda or out_dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    (m, k), n = a.shape, b.shape[0]
    if m == 0 or k % SCALE_BLOCK or n % 8:
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (a, b))  # fmt: skip


def _matrix(t: torch.Tensor, block_rows: int, block_cols: int):
    """t [rows, cols] (contiguous rows) in [block_rows, block_cols] boxes."""
    return rows_descriptor(t, t.shape[0], t.shape[1], t.stride(0), block_rows, block_cols)


def fp8_gemm_ws(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, K/128] float32, any strides (column-major is the engine's)
    b: torch.Tensor,  # [N, K] float8_e4m3fn
    b_scale: torch.Tensor,  # [N/128, K/128] float32
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [M, N] bf16
    """The block-scaled product on the warp-specialized kernel; the caller checks `supports`
    (and fp8_gemm._check_operands) first."""
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _fp8_gemm_ws_kernel[grid](
        _matrix(a, HALF_M, SCALE_BLOCK), _matrix(b, BLOCK_N, SCALE_BLOCK),
        _matrix(out, HALF_M, BLOCK_N), a_scale, b_scale, m, n, k,
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), GROUP=GROUP_M,
        num_warps=4, maxnreg=LAUNCH_REGISTERS,
    )  # fmt: skip
    return out
