#!/usr/bin/env bash
# Nsight Compute profiles of the kernels whose targets are missed (one GPU, results under $OUT):
# the MXFP4 fused MoE at 128 and 4,096 tokens (issue 29), the bf16 and FP8 fused MoE at 4,096
# (issue 30), sparse MLA decode at 64 queries (issue 22). Each case runs
# benchmarks/ncu_cases.py; ncu keeps the clocks as they are (--clock-control none).
#   CASES="mxfp4:128 mxfp4:4096" bash benchmarks/ncu_profile.sh
# Per case: $OUT/ncu_<case>_<size>.txt (details: throughput, occupancy, launch, warp stalls);
# with SOURCE=1 also the SASS of the first profiled kernel with its stall samples (CSV).
set -uo pipefail
OUT=${OUT:-/tmp} SOURCE=${SOURCE:-0}
CASES=${CASES:-mxfp4:128 mxfp4:4096 moe:4096 fp8moe:4096 sparse_mla:64}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
declare -A KERNELS=([mxfp4]=mxfp4 [moe]=moe_.*gemm [fp8moe]=moe_.*gemm [sparse_mla]=sparse_mla)
for item in $CASES; do
  case=${item%%:*} size=${item##*:} name=ncu_${item/:/_}
  timeout 240 "$NCU" --clock-control none --profile-from-start off --set full \
    --kernel-name "regex:${KERNELS[$case]}" -f -o "/tmp/$name" \
    python3 benchmarks/ncu_cases.py "$case" "$size" >"/tmp/$name.log" 2>&1 \
    || { echo "$item: ncu failed"; tail -5 "/tmp/$name.log"; continue; }
  "$NCU" -i "/tmp/$name.ncu-rep" --page details >"$OUT/$name.txt"
  if [ "$SOURCE" = 1 ]; then
    "$NCU" -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass --launch-count 1 \
      >"$OUT/${name}_sass.csv" 2>&1
  fi
  grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Block Limit|Issue Slots Busy|Warp Cycles Per Issued" \
    "$OUT/$name.txt" | head -60
done
