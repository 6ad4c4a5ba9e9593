#!/usr/bin/env bash
# Issue 28's measurement on one GPU: DeepSeek-V2-Lite shapes with random weights and the built-in
# tiny model's 1,000-token vocabulary (so its tokenizer decodes every token), 64 prompts of 3,700
# tokens, 128 output tokens: the offline engine, then `serve run` in the given mode, through
# benchmarks/serve_vs_offline.sh. Arguments go to `build` (e.g. disaggregate=false, or
# disaggregate=true). Run through the device tool with carry [".device"]; results under $OUT.
#   bash benchmarks/serve_v2lite.sh disaggregate=false
set -uo pipefail
[ -n "${NO_BUNDLE:-}" ] || source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NO_BUNDLE=1
MODEL=${MODEL:-/tmp/v2lite-1k}
python - "$MODEL" <<'PY'
import json, pathlib, shutil, sys
from rayinfer.engine.model_source import resolve_model_path

tiny, out = resolve_model_path("tiny"), pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
config = json.loads(pathlib.Path("benchmarks/configs/deepseek-v2-lite/config.json").read_text())
config["vocab_size"] = 1000
(out / "config.json").write_text(json.dumps(config, indent=1))
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tiny / name, out / name)
PY
MODEL=$MODEL bash benchmarks/serve_vs_offline.sh load_format=dummy "$@"
