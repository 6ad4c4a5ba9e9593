#!/usr/bin/env bash
# Mixed steps from piecewise CUDA graphs against eager ones (issue 28): the offline engine on
# DeepSeek-V2-Lite shapes (benchmarks/v2lite_folder.py, random weights), 48 prompts of 3,700
# tokens, 128 output tokens, 16 in flight (the next added as one finishes, as `bench serve
# --max-concurrency 16` keeps a server), per step budget in $BUDGETS (empty: none), each with
# piecewise graphs up to $PIECEWISE tokens (0: eager mixed steps). Then, with SERVE_BUDGET set,
# `serve run` colocated at that budget, through benchmarks/serve_v2lite.sh (16 streams; further
# arguments go to `build`, e.g. engine.max_graph_piecewise_tokens=0). Run through the
# device tool with carry [".device"]; results under $OUT:
#   BUDGETS="8192 1024" PIECEWISE="4096 0" bash benchmarks/piecewise_graphs.sh
set -uo pipefail
[ -n "${NO_BUNDLE:-}" ] || source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NO_BUNDLE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp} MODEL=${MODEL:-/tmp/v2lite-1k}
BUDGETS=${BUDGETS-8192 1024 512} PIECEWISE=${PIECEWISE-4096 0}
python benchmarks/v2lite_folder.py "$MODEL"
for budget in $BUDGETS; do
  for pieces in $PIECEWISE; do
    [ "$pieces" -gt "$budget" ] && pieces=$budget
    name=offline_c16_b${budget}_pw${pieces}
    echo "== $name: budget $budget, piecewise graphs up to $pieces tokens"
    timeout "${OFFLINE_TIMEOUT:-400}" python -m rayinfer.bench throughput --model "$MODEL" \
      --load-format dummy --tokenizer "$MODEL" --num-prompts "${NUM_PROMPTS:-48}" \
      --input-len 3700 --output-len 128 --seed 0 --max-concurrency 16 \
      --warmup-prompts "${WARMUP_PROMPTS:-16}" --max-num-batched-tokens "$budget" \
      --max-graph-piecewise-tokens "$pieces" --json "$OUT/$name.json" 2>&1 \
      | grep -e "throughput" -e "P50 T" -e "Mean T" -e "rror" -e "steps (last" | head -12
  done
done
if [ -n "${SERVE_BUDGET:-}" ]; then
  OFFLINE=0 SERVE_PASSES=c16 RATES= NUM_PROMPTS=${NUM_PROMPTS:-48} \
    bash benchmarks/serve_v2lite.sh disaggregate=false \
    engine.max_num_batched_tokens="$SERVE_BUDGET" "$@"
fi
