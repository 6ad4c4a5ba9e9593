#!/usr/bin/env bash
# Issue 7 in one device call on nvidia-h200-x8 (WORLD=8) or nvidia-h200-x4 (WORLD=4), carry
# [".device"]: the all-to-all schedules against NCCL and the cost model (NVLink and host-staged),
# then DeepSeek-V2-Lite shapes with expert parallelism over every GPU, overlap off and on (decode
# from CUDA graphs over NCCL for "dist", eager for "host"),
# against transformers on one GPU. Results under $OUT; paste the tables into RESULTS.md.
set -uo pipefail
source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD:$PYTHONPATH TOKENIZERS_PARALLELISM=false
WORLD=${WORLD:-8}
OUT=${OUT:-/tmp/world$WORLD}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
# both phases in fresh processes (NCCL_P2P_DISABLE=1 for the host-staged one); the table's
# "model" column is the cost model's prediction over the measured time, per schedule
timeout 240 python -m rayinfer.bench comm --world-size "$WORLD" --tokens 128 1024 4096 16384 \
    --iters 10 --out "$OUT/comm" 2>&1 | grep -e "^|" -e "^#" -e Error | head -60
timeout 300 python -m rayinfer.bench parallel --config benchmarks/configs/deepseek-v2-lite \
    --plans tp=1 "dp=$WORLD,ep=$WORLD" --transports host dist --overlap off on \
    --prompt-lens 4096 16384 --decode-batches 1 64 256 --decode-tokens 32 --repeats 2 \
    --json "$OUT/parallel.json" 2>&1 | grep -e prefill -e decode -e FAIL
