"""MLA prefill: building the [s, N, 192] key from k_nope [s, N, 128] (a view of kv_b_proj's output)
and the head-shared k_pe [s, 64], and the query from its rotated rope part: torch.cat (what
layers/mla.py did) against copies into one buffer (what it does now). One H200, bf16, medians of
`triton.testing.do_bench`; equality of the results is checked first.

    PYTHONPATH=$PWD python benchmarks/mla_key_assembly.py [--tokens 4096 16384]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton

HEADS, NOPE, ROPE, V = 16, 128, 64, 128


def by_cat(kv, k_pe, q, q_pe_rotated):
    k_nope = kv[..., :NOPE]
    key = torch.cat((k_nope, k_pe[:, None, :].expand(-1, HEADS, -1)), dim=-1)
    query = torch.cat((q[..., :NOPE], q_pe_rotated), dim=-1)
    return key, query


def by_copies(kv, k_pe, q, q_pe_rotated):
    key = kv.new_empty(kv.shape[0], HEADS, NOPE + ROPE)
    key[..., :NOPE] = kv[..., :NOPE]
    key[..., NOPE:] = k_pe[:, None, :]
    q[..., NOPE:] = q_pe_rotated
    return key, q


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    for tokens in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        kv = torch.randn(tokens, HEADS, NOPE + V, device="cuda", generator=gen).bfloat16()
        k_pe = torch.randn(tokens, ROPE, device="cuda", generator=gen).bfloat16()
        q = torch.randn(tokens, HEADS, NOPE + ROPE, device="cuda", generator=gen).bfloat16()
        q_pe = torch.randn(tokens, HEADS, ROPE, device="cuda", generator=gen).bfloat16()
        expected = by_cat(kv, k_pe, q, q_pe)
        got = by_copies(kv, k_pe, q.clone(), q_pe)
        exact = all(torch.equal(a, b) for a, b in zip(expected, got))
        inputs = (kv, k_pe, q, q_pe)
        cat_ms = triton.testing.do_bench(functools.partial(by_cat, *inputs))
        copy_ms = triton.testing.do_bench(functools.partial(by_copies, *inputs))
        print(
            f"tokens {tokens:6d}: cat {cat_ms * 1e3:7.1f} us  copies {copy_ms * 1e3:7.1f} us  "
            f"({cat_ms / copy_ms:.2f}x)  equal: {exact}"
        )


if __name__ == "__main__":
    main()
