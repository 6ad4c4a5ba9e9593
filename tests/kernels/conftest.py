"""Kernel tests run Triton on CPU tensors through the interpreter: tests/conftest.py sets
TRITON_INTERPRET before anything imports Triton."""
