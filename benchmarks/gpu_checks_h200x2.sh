#!/usr/bin/env bash
# One device call (nvidia-h200-x2, carry [".device"]): the engine's parity with transformers on CUDA
# (tests/gpu/test_engine_parity.py), the host-staged copy probe, and a profile of prefill/decode
# steps of a full-size model.
set -uo pipefail
source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD:$PYTHONPATH TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
timeout 300 python -m pytest -q -m gpu tests/gpu/test_engine_parity.py 2>&1 | tail -25
timeout 60 python benchmarks/comm_host_copy_probe.py 2>&1 | tail -30
timeout 150 python benchmarks/profile_engine.py --config benchmarks/configs/deepseek-v2-lite 2>&1 | grep -v -e Loading -e "it/s]" | cut -c1-170
