"""Turn `python -m rayinfer.bench kernels moe --sweep --out R.json` results into the tile files
rayinfer/kernels/configs/fused_moe.json and fp8_gemm.json.

    python benchmarks/moe_configs_from_results.py R.json

Token buckets: the 128-token (decode) tiles serve up to 512 tokens (<= 16 slots per expert at
top-8 of 256), the 4,096-token tiles above 1,024; 1,024 takes the 4,096-token fp8 tiles and, for
bf16, the 64-row tiles of run 1 (w13 5.8 ms, w2 2.9 ms at 4,096 tokens), since 128-row tiles
would be three-quarters padding at 32 slots per expert. Other shapes get the same buckets.
"""

import json
import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "rayinfer" / "kernels" / "configs"
BF16_1024 = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 4,
             "num_stages": 4}  # fmt: skip


def moe_buckets(by_tokens: dict, kind: str) -> dict:
    decode, prefill = by_tokens["128"], by_tokens["4096"]
    middle = prefill if kind == "fp8" else {"w13": BF16_1024, "w2": BF16_1024}
    return {"512": decode, "1024": middle, "4096": prefill}


def main(path: str) -> None:
    results = json.loads(Path(path).read_text())
    device = results["device"]
    moe, gemm = {}, {}
    for r in results["moe"]:
        moe.setdefault(r["dtype"], {})[str(r["tokens"])] = r["config"]
    moe_file = {}
    for kind, by_tokens in moe.items():
        buckets = moe_buckets(by_tokens, kind)
        moe_file[f"{kind},E=256,I=2048,H=7168"] = moe_file[kind] = buckets
    for r in results["fp8_gemm"]:
        gemm.setdefault(f"N={r['N']},K={r['K']}", {})[str(r["M"])] = r["config"]
    gemm["default"] = gemm["N=7168,K=2048"]
    for name, data in (("fused_moe", moe_file), ("fp8_gemm", gemm)):
        text = json.dumps({device: data}, indent=1, sort_keys=True)
        (CONFIG_DIR / f"{name}.json").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
