"""Kernel tests run Triton on CPU tensors through the interpreter, set before triton loads."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
