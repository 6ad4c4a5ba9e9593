#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64, no registry there) into .whl, which git ignores
# here (.git/info/exclude) and a device call carries; that call installs them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# and puts /tmp/site first on PYTHONPATH (benchmarks/gpu_v4_figures.sh does). Each package
# comes without its dependencies: name every one the machine lacks. For DeepSeek-V4 bf16 parity:
#   bash benchmarks/device_wheels.sh transformers==5.25.0 huggingface-hub==2.4.0 \
#       tokenizers==0.23.3 safetensors==0.8.0 kernels regex
set -euo pipefail
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
ls -la .whl
