"""Checks of the warp-specialized Gluon MLA decode (mla_decode_hopper), both forms, against the
float32 reference, then their times from CUDA graphs against the shipped configs, on an H200.

    PYTHONPATH=$PWD timeout 120 python benchmarks/gluon_mla_decode.py [--out mla_ws.json]

Run it under `timeout` before `sweep_mla_decode.py` (whose Gluon configs also have it): a kernel
that hangs then costs two minutes, not the sweep. Checks (bf16, relative max error < 2e-2, no
NaN), for the heads-major form (64-row query tiles, layout "gluon_ws") and the tokens-major one
(the tile's tokens as wgmma's rows, layout "gluon_ws_tokens"): 16, 32 and 128 heads; one split
and many; contexts ending mid-tile and mid-block; a padding row without context (zeros
expected). Timings: 16 heads at 8 x 32k, 32 x 8k, 128 x 4k and 1 x 128k, and 128 heads at
8 x 32k, with the KV bytes' share of 4.23 TB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from rayinfer.bench.attention_cases import paged_mla_case  # noqa: E402
from rayinfer.kernels.attention.paged_attention import launch_params  # noqa: E402
from rayinfer.kernels.mla import mla_attention, mla_decode_hopper  # noqa: E402

SCALE = 192**-0.5
SPLITS = dict(target_programs=528, min_tokens_per_split=64, max_splits=256)
GLUON = dict(layout="gluon_ws", BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2, **SPLITS)
TOKENS = {**GLUON, "layout": "gluon_ws_tokens"}
CHECKS = [  # (heads, context lengths, extra params)
    (16, [1, 17, 64, 333, 4096], {}),
    (16, [20000, 5], {}),
    (16, [200, 0], dict(max_splits=1)),  # one split writes the output itself; a padding row
    (32, [70, 1000], dict(BLOCK_H=32)),
    (128, [1, 100, 3000], dict(BLOCK_H=64)),
]
FORMS = {"heads_major": GLUON, "tokens_major": TOKENS}
TIMED = [(16, 8, 32768), (16, 32, 8192), (16, 128, 4096), (16, 1, 131072), (128, 8, 32768)]


def case(seq_lens: list[int], heads: int) -> dict:
    return paged_mla_case(seq_lens, heads, 512, 64, 16, torch.bfloat16, torch.device("cuda"))


def decode(data: dict, params: dict) -> torch.Tensor:
    return mla_attention.mla_decode_attention(
        data["q_latent"], data["q_pe"], data["kv_cache"], data["block_tables"],
        data["seq_lens"], SCALE, params=params,
    )  # fmt: skip


def check(form: str, heads: int, seq_lens: list[int], extra: dict) -> dict:
    data = case(seq_lens, heads)
    kv = data["kv_cache"].view(-1, 576)
    assert mla_decode_hopper.supports(data["q_latent"], data["q_pe"], kv, 16, 64)
    ours = decode(data, {**FORMS[form], **extra}).float()
    reference = mla_attention.mla_decode_attention_reference(
        data["q_latent"].float(), data["q_pe"].float(), data["kv_cache"].float(),
        data["block_tables"], seq_lens, SCALE,
    )  # fmt: skip
    lives = torch.tensor([n > 0 for n in seq_lens], device="cuda")
    error = ((ours - reference)[lives].abs().max() / reference[lives].abs().max()).item()
    padding_zero = bool((ours[~lives] == 0).all())
    ok = not torch.isnan(ours[lives]).any().item() and error < 2e-2 and padding_zero
    return dict(form=form, heads=heads, seq_lens=seq_lens, extra=extra, rel_error=error, ok=ok)


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = dict(gpu=torch.cuda.get_device_name(), checks=[])
    for form in FORMS:
        for heads, seq_lens, extra in CHECKS:
            results["checks"].append(check(form, heads, seq_lens, extra))
            print(json.dumps(results["checks"][-1]), flush=True)
    passed = {
        form for form in FORMS if all(c["ok"] for c in results["checks"] if c["form"] == form)
    }
    results["timings"] = []
    for heads, batch, seq_len in TIMED:
        data = case([seq_len] * batch, heads)
        row = dict(heads=heads, batch=batch, context=seq_len)
        kv_bytes = batch * seq_len * 576 * 2
        block_h = dict(BLOCK_H=min(heads, 64))
        contenders = {"shipped": launch_params("mla_attention", torch.device("cuda"), heads)}
        contenders.update({form: {**FORMS[form], **block_h} for form in FORMS if form in passed})
        for name, params in contenders.items():
            ms = graph_ms(lambda: decode(data, params))  # noqa: B023
            row[name] = dict(ms=ms, hbm_share=kv_bytes / ms / 1e-3 / 4.23e12)
        results["timings"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
