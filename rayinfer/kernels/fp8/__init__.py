"""FP8 e4m3 with block scales: activation quantization and the W8A8 GEMM."""
