"""DeepSeek-V2-Lite (random weights) on one GPU at 128k, 262k and 1M-token prompts: prefill
seconds and input tokens/s in 16k chunks, then decode ms/token at the longest context; one JSON
line per result. The measurement is `python -m rayinfer.bench long_context`'s; this fixes the
model, the lengths and one GPU's cache, and can cut the layers for a quicker reading (attention
dominates past 128k, so seconds scale with the layer count).

    python benchmarks/long_context.py                 # 27 layers: ~6-7 min on an H200
    python benchmarks/long_context.py --layers 4      # ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.bench import long_context  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "deepseek-v2-lite" / "config.json"
LENGTHS = (131072, 262144, 1048576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="default: the config's 27")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--decode-tokens", type=int, default=8, help="after the longest prompt")
    args = parser.parse_args()
    hf = json.loads(CONFIG.read_text())
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], 2 * max(args.lengths))
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(hf))
        bench_args = long_context.parse_args([
            "--config", folder, "--lengths", *map(str, args.lengths), "--dense-lengths",
            "--decode-batch", "0", "--decode-after-longest", str(args.decode_tokens),
            "--block-size", "16", "--chunk", "16384",
        ])  # fmt: skip
        llm = long_context.build(Path(folder), bench_args, args.lengths)
        results = long_context.measure(llm, bench_args, args.lengths)
        long_context.release(llm)
    for entry in results["prefill"]:
        print(json.dumps({"model": "deepseek-v2-lite", "layers": hf["num_hidden_layers"],
                          **entry}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
