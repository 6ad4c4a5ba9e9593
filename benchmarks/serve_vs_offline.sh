#!/usr/bin/env bash
# `serve run rayinfer.app:build` against the offline engine on the same prompts (issue 28), then
# optionally `transformers serve` with the same client, and a table of ratios last:
#   1. offline: `python -m rayinfer.bench throughput`, all requests at once (--seed 0), then
#      16 and 64 in flight (--max-concurrency, the serve passes' seeds and shapes);
#   2. `serve run rayinfer.app:build model=$MODEL "$@"`, then `python -m rayinfer.bench serve` at
#      concurrency 16 (--seed 0: the offline run's prompts) and 64 (--seed 1: fresh prompts, so
#      the server's prefix cache cannot serve them), then a Poisson sweep over $RATES with goodput;
#   3. with WITH_TRANSFORMERS=1: rayinfer at concurrency 16 on text prompts (--seed 50), then
#      `transformers serve` on the same folder, same client, same prompts.
# Each serve pass sends $WARMUPS (16) untimed requests first, as the offline runs warm up;
# OFFLINE=0 skips step 1; SERVE_PASSES (default "c16 c64"; chatN / jsonN: chat at 16 streams
# without / with a json_schema response_format) and RATES (empty: no sweep) choose the
# serve passes. Arguments go to `build`, e.g. `disaggregate=false load_format=dummy` or `disaggregate=true`;
# with load_format=dummy the offline engine draws random weights too (transformers serve needs
# real weights in the folder: without *.safetensors it is skipped). Run through the device tool
# with carry [".device"] (the Ray bundle, see shared/device/README.md); results under $OUT:
#   MODEL=/path/to/ckpt bash benchmarks/serve_vs_offline.sh disaggregate=false load_format=dummy
# transformers serve needs `accelerate` (it loads with a device map). Its continuous batching
# (5.24) ran a Llama checkpoint on the CPU but failed on a DeepSeek-V3 (MLA) one (index_copy_
# shapes), so the script falls back to plain generate ($TRANSFORMERS_FALLBACK_ARGS) if it fails.
set -uo pipefail
[ -n "${NO_BUNDLE:-}" ] || source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp}
: "${MODEL:?set MODEL to a checkpoint folder}"
NUM_PROMPTS=${NUM_PROMPTS:-64} INPUT_LEN=${INPUT_LEN:-3700} OUTPUT_LEN=${OUTPUT_LEN:-128}
RATES=${RATES-1,2,4,8,inf} WARMUPS=${WARMUPS:-16} SERVE_PASSES=${SERVE_PASSES-c16 c64} GOODPUT=${GOODPUT:-ttft:2000 tpot:50}
OFFLINE_ARGS=${OFFLINE_ARGS:---max-num-batched-tokens 8192}
TRANSFORMERS_ARGS=${TRANSFORMERS_ARGS:---continuous-batching --dtype bfloat16}
PORT=${PORT:-8000} TF_PORT=${TF_PORT:-8001} TRANSFORMERS_DEVICE=${TRANSFORMERS_DEVICE:-cuda}
DATASET=(--num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --tokenizer "$MODEL")
LOAD_FORMAT=safetensors
for arg in "$@"; do [ "$arg" = load_format=dummy ] && LOAD_FORMAT=dummy; done
TRANSFORMERS=(transformers)  # the CLI; through Python where no console script is installed
command -v transformers >/dev/null || TRANSFORMERS=(python -m transformers.cli.transformers)
SERVE=(serve)
command -v serve >/dev/null || SERVE=(python -c 'import sys; from ray.serve.scripts import cli; sys.argv[0] = "serve"; cli()')
bench() {  # bench NAME URL [bench args...]: one `bench serve` run, its JSON at $OUT/NAME.json
  local name=$1 url=$2; shift 2
  echo "== $name"
  timeout "${BENCH_TIMEOUT:-900}" python -m rayinfer.bench serve --url "$url" "${DATASET[@]}" \
    --num-warmups "$WARMUPS" --json "$OUT/$name.json" "$@" 2>&1 | grep -e "throughput" -e "Mean T" -e "P95 TTFT" \
    -e "Successful" -e "Failed" -e "failed" -e "rate req/s" -e "^ *[0-9.inf]* |" -e "error" -e "plot"
}
wait_up() {  # wait_up URL SECONDS
  for _ in $(seq 1 "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "no server at $1 after $2 s"; return 1
}

offline() {  # offline NAME [bench throughput args...]: its JSON at $OUT/NAME.json
  local name=$1; shift
  echo "== $name: offline engine ($LOAD_FORMAT weights) $*"
  # shellcheck disable=SC2086
  timeout "${OFFLINE_TIMEOUT:-900}" python -m rayinfer.bench throughput --model "$MODEL" \
    --load-format "$LOAD_FORMAT" "${DATASET[@]}" $OFFLINE_ARGS --json "$OUT/$name.json" "$@" \
    2>&1 | grep -e "throughput" -e "P50 T" -e "Successful" -e "Error" | head -12
}
if [ "${OFFLINE:-1}" = 1 ]; then
  offline offline --seed 0
  # The serve passes' shapes: as many in flight as the client keeps (its seeds, its prompts).
  offline offline_c16 --seed 0 --max-concurrency 16
  offline offline_c64 --seed 1 --max-concurrency 64
fi

timeout "${SERVE_TIMEOUT:-2400}" "${SERVE[@]}" run rayinfer.app:build model="$MODEL" "$@" \
  >"$OUT/serve_vs_offline_serve.log" 2>&1 &
SERVE_PID=$!
if wait_up "http://127.0.0.1:$PORT" "${UP_TIMEOUT:-600}"; then
  URL=http://127.0.0.1:$PORT
  for pass in $SERVE_PASSES; do
    case $pass in
      c16) bench serve_c16 "$URL" --max-concurrency 16 --seed 0 ;;
      c64) bench serve_c64 "$URL" --max-concurrency 64 --seed 1 ;;
      # chat at 16 streams without and with structured output (issue 25), alternated, each
      # pass on fresh prompts: chat1 json1 chat2 json2
      chat[0-9]) bench "serve_$pass" "$URL" --endpoint chat --max-concurrency 16 --seed "2${pass#chat}0" ;;
      json[0-9])
        echo '{"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object",
          "properties": {"text": {"type": "string"}}, "required": ["text"]}}}' >"$OUT/format.json"
        bench "serve_$pass" "$URL" --endpoint chat --max-concurrency 16 --seed "2${pass#json}1" \
          --response-format "$OUT/format.json" ;;
    esac
  done
  # shellcheck disable=SC2086
  [ -n "$RATES" ] && bench serve_sweep "$URL" --request-rate "$RATES" --seed 10 \
    --goodput $GOODPUT --plot "$OUT/serve_sweep.png"
  [ -n "${WITH_TRANSFORMERS:-}" ] && bench serve_c16_text "$URL" --max-concurrency 16 --seed 50 --text-prompts
else
  tail -40 "$OUT/serve_vs_offline_serve.log"
fi
# The dashboard of the cluster `serve run` started or joined (DASHBOARD_URL where it is not local).
"${SERVE[@]}" shutdown -y --address "${DASHBOARD_URL:-http://127.0.0.1:8265}" >/dev/null 2>&1
kill "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null

if [ -n "${WITH_TRANSFORMERS:-}" ]; then
  if ! ls "$MODEL"/*.safetensors >/dev/null 2>&1; then
    echo "== transformers serve skipped: $MODEL has no *.safetensors (load_format=dummy?)"
  elif ! python -c "import accelerate" 2>/dev/null; then
    echo "== transformers serve skipped: it needs accelerate (pip install accelerate)"
  else
    # Continuous batching first; where it fails (as on MLA checkpoints), plain generate.
    for args in "$TRANSFORMERS_ARGS" "${TRANSFORMERS_FALLBACK_ARGS:---dtype bfloat16}"; do
      echo "== transformers serve $args"
      # shellcheck disable=SC2086
      timeout "${SERVE_TIMEOUT:-2400}" "${TRANSFORMERS[@]}" serve --port "$TF_PORT" \
        --device "$TRANSFORMERS_DEVICE" $args >"$OUT/serve_vs_offline_transformers.log" 2>&1 &
      TF_PID=$!
      if wait_up "http://127.0.0.1:$TF_PORT" 300; then
        bench transformers_c16 "http://127.0.0.1:$TF_PORT" --backend transformers \
          --model "$MODEL" --max-concurrency 16 --seed 50
      fi
      kill "$TF_PID" 2>/dev/null; wait "$TF_PID" 2>/dev/null
      grep -m3 -iE "error|CB:" "$OUT/serve_vs_offline_transformers.log"
      [ -s "$OUT/transformers_c16.json" ] && break
    done
  fi
fi

echo "== ratios"
python - "$OUT" <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
def summary(name):
    path = out / f"{name}.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record["summary"] if "summary" in record else record["passes"][0]["summary"]

def ratio(a, b, key, invert=False):
    if not a or not b or not a.get(key) or not b.get(key):
        return "n/a"
    return f"{(b[key] / a[key]) if invert else (a[key] / b[key]):.2f}x"

offline = summary("offline")
rows = [("serve c16 / offline (all at once)", summary("serve_c16"), offline),
        ("serve c64 / offline (all at once)", summary("serve_c64"), offline),
        ("serve c16 / offline c16", summary("serve_c16"), summary("offline_c16")),
        ("serve c64 / offline c64", summary("serve_c64"), summary("offline_c64")),
        ("transformers c16 / rayinfer c16 (text)", summary("transformers_c16"),
         summary("serve_c16_text"))]
rows += [(f"json_schema / plain chat c16, pass {i}", summary(f"serve_json{i}"),
          summary(f"serve_chat{i}")) for i in range(1, 10)]
print(f"{'':40} {'input tok/s':>12} {'output tok/s':>13} {'P50 TPOT':>9} {'P50 TTFT':>9}")
for label, a, b in rows:
    if a is None or b is None:
        continue
    print(f"{label:40} {ratio(a, b, 'input_throughput'):>12} {ratio(a, b, 'output_throughput'):>13} "
          f"{ratio(a, b, 'p50_tpot_ms'):>9} {ratio(a, b, 'p50_ttft_ms'):>9}")
sweep = out / "serve_sweep.json"
if sweep.is_file():
    for p in json.loads(sweep.read_text())["passes"]:
        s = p["summary"]
        print(f"rate {p['request_rate']:>5}: {s['request_throughput']:.2f} req/s, goodput "
              f"{100 * s['goodput_fraction']:.0f}% ({s['request_goodput']:.2f} req/s), "
              f"P95 TTFT {s['p95_ttft_ms']:.0f} ms")
EOF
