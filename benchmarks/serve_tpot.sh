#!/usr/bin/env bash
# Issue 28's TPOT on one GPU: the offline engine at $STREAMS (16 or 64) requests in flight (its
# cache sized as serve sizes one, bench throughput's default on GPUs), then `serve run` passes
# ($MODE: colocated, or disaggregated with Prefill and Decode sharing the GPU) on the same
# prompts (the serve client's seed for that concurrency), one `serve run` each, on one warm
# machine. Each serve pass prints the client's
# P50 TPOT / TTFT / input tok/s and the replica's step log (rayinfer/deployments/
# step_log.py: decode-alone and prompt steps, a decode step split between replica and worker).
# DeepSeek-V2-Lite shapes with random weights (benchmarks/v2lite_folder.py), 3,700-token prompts,
# 128 output tokens, $N prompts (64), budget 8,192. PASSES: "name[:key=value,...]" per pass,
# the keys going to `build` (default: "default held05:engine.waiting_served_ratio=0.5").
# Run through the device tool with carry [".device"]; results under $OUT/<name>/:
#   bash benchmarks/serve_tpot.sh
set -uo pipefail
[ -n "${NO_BUNDLE:-}" ] || source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NO_BUNDLE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp} MODEL=${MODEL:-/tmp/v2lite-1k} N=${N:-64}
PASSES=${PASSES-default held05:engine.waiting_served_ratio=0.5}
STREAMS=${STREAMS:-16} MODE=${MODE:-colocated}
case $STREAMS in 16) SEED=0 ;; 64) SEED=1 ;; *) echo "STREAMS is 16 or 64"; exit 2 ;; esac
case $MODE in
  colocated) MODE_ARGS=(disaggregate=false engine.max_num_batched_tokens=8192) ;;
  disaggregated) MODE_ARGS=(disaggregate=true prefill.max_num_batched_tokens=8192) ;;
  *) echo "MODE is colocated or disaggregated"; exit 2 ;;
esac
python benchmarks/v2lite_folder.py "$MODEL" >/dev/null
export MODEL NUM_PROMPTS=$N RATES= SERVE_PASSES=c$STREAMS UP_TIMEOUT=${UP_TIMEOUT:-240}
export BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
port_free() {  # the last pass's server gone from port 8000
  for _ in $(seq 1 60); do curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 || return 0; sleep 1; done
}
if [ "${OFFLINE:-1}" = 1 ]; then
  echo "#### offline, $STREAMS in flight"
  timeout "${OFFLINE_TIMEOUT:-200}" python -m rayinfer.bench throughput --model "$MODEL" \
    --load-format dummy --tokenizer "$MODEL" --num-prompts "$N" --input-len 3700 \
    --output-len 128 --max-num-batched-tokens 8192 --seed $SEED --max-concurrency "$STREAMS" \
    --warmup-prompts 16 --json "$OUT/offline_c$STREAMS.json" 2>&1 \
    | grep -e "Input token" -e "P50 T" -e "Mean T" -e "rror" | head -8
  python -c "import json, sys; print(json.load(open(sys.argv[1]))['steps'])" "$OUT/offline_c$STREAMS.json"
fi
for pass in $PASSES; do
  name=${pass%%:*} args=()
  [ "$name" != "$pass" ] && IFS=, read -r -a args <<<"${pass#*:}"
  port_free; sleep 3
  mkdir -p "$OUT/$name"
  echo "#### serve $name: ${args[*]}"
  OUT=$OUT/$name OFFLINE=0 SERVE_TIMEOUT=${SERVE_TIMEOUT:-330} \
    bash benchmarks/serve_vs_offline.sh load_format=dummy "${MODE_ARGS[@]}" "${args[@]}" 2>&1 \
    | grep -e "Failed" -e "rror"
  python - "$OUT/$name/serve_c$STREAMS.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["passes"][0]["summary"]
    print("   P50 TPOT %.2f ms, P50 TTFT %.0f ms, input %.0f tok/s, mean ITL %.1f ms" % (
        s["p50_tpot_ms"], s["p50_ttft_ms"], s["input_throughput"], s["mean_itl_ms"]))
    if s.get("mean_kv_bytes"):
        print("   hand-off export / import P50 %.2f / %.2f ms (P95 %.2f / %.2f), share of TTFT "
              "P50 %.1f%% (mean %.1f%%), ways %s" % (
            s["p50_kv_export_ms"], s["p50_kv_import_ms"], s["p95_kv_export_ms"],
            s["p95_kv_import_ms"], s["p50_handoff_share_of_ttft_pct"],
            s["mean_handoff_share_of_ttft_pct"], s["kv_copies"]))
        print("   share of TTFT at P50: export %.2f%%, import %.2f%%; P50 first ITL %.1f ms "
              "(P50 ITL %.1f ms)" % (s["p50_kv_export_share_of_ttft_pct"],
              s["p50_kv_import_share_of_ttft_pct"], s["p50_first_itl_ms"], s["p50_itl_ms"]))
except Exception as error:  # noqa: BLE001
    print("   no summary:", error)
PY
  grep -o "engine steps in.*" "$OUT/$name/serve_vs_offline_serve.log" | tail -2
  # kernels the workers compiled after startup (workers/kernel_compiles.py): steps that waited
  echo "   compiles after startup: $(grep -c "compiled Triton kernel" "$OUT/$name/serve_vs_offline_serve.log")"
  grep -o "compiled Triton kernel.*" "$OUT/$name/serve_vs_offline_serve.log" | tail -1
done
