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
python benchmarks/v2lite_folder.py "$MODEL"
MODEL=$MODEL bash benchmarks/serve_vs_offline.sh load_format=dummy "$@"
