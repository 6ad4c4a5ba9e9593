"""The Gluon sparse MLA kernel's split policies at GLM-5 shapes, 1 / 16 / 64 decodes over 128k
(CUDA-graph medians; the Triton kernel of the same run first): one or two programs per SM, splits
of at least 64 / 128 / 256 list entries.

    python benchmarks/sparse_mla_policy.py
"""

import functools

import torch

from rayinfer.bench import kernels_dsa
from rayinfer.bench.graph_timing import graph_median_ms
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention

GLUON_ENTRY = dict(layout="gluon_ws", BLOCK_H=64, BLOCK_N=64, num_warps=4, num_stages=2,
                   target_programs=132, max_splits=32)  # fmt: skip


def main() -> None:
    copy = kernels_dsa.copy_bytes_per_s()
    print(torch.cuda.get_device_name(), f"copy {copy / 1e12:.2f} TB/s", flush=True)
    for batch in (1, 16, 64):
        inputs = kernels_dsa.sparse_attention_inputs(batch, 131072)
        run = functools.partial(sparse_mla_attention, *inputs)
        triton_ms = graph_median_ms(functools.partial(run, backend="triton"))
        line = [f"B={batch} triton {triton_ms * 1e3:.1f} us"]
        for per_sm in (1, 2):
            for min_tokens in (64, 128, 256):
                params = dict(GLUON_ENTRY, programs_per_sm=per_sm, whole_waves=per_sm == 1,
                              min_tokens_per_split=min_tokens)  # fmt: skip
                ms = graph_median_ms(functools.partial(run, params=params))
                share = kernels_dsa.attention_bytes(batch) / (ms * 1e-3) / copy
                line.append(f"{per_sm}/SM, >={min_tokens}: {ms * 1e3:.1f} us {share:.0%}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
