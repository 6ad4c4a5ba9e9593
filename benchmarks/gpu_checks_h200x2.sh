#!/usr/bin/env bash
# One device call (nvidia-h200-x2, carry [".device"]): the engine's bf16 parity with transformers on
# CUDA, the host-staged copy probe, and a profile of prefill/decode steps of a full-size model.
set -uo pipefail
source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD:$PYTHONPATH TOKENIZERS_PARALLELISM=false
timeout 100 python benchmarks/gpu_engine_parity.py --out "${OUT:-/tmp}/parity.json" 2>&1 | grep -v -e Loading -e "it/s]" | tail -25
timeout 60 python benchmarks/comm_host_copy_probe.py 2>&1 | tail -30
timeout 150 python benchmarks/profile_engine.py --config benchmarks/configs/deepseek-v2-lite 2>&1 | grep -v -e Loading -e "it/s]" | cut -c1-170
