"""A worker's CompileWatch on a GPU: a kernel compiled after startup is counted and logged with
its time, one compiled before is not, and a cached specialization is not compiled again:

    python -m pytest -q -m gpu tests/gpu/test_kernel_compiles.py
"""

import logging

import pytest
import torch

from rayinfer.workers.kernel_compiles import CompileWatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gpu_compiles_after_startup_are_logged_with_their_time(caplog):
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x, n, FACTOR: tl.constexpr):
        offsets = tl.arange(0, 128)
        mask = offsets < n
        tl.store(x + offsets, tl.load(x + offsets, mask=mask) * FACTOR, mask=mask)

    watch = CompileWatch()
    assert watch.install()
    x = torch.ones(100, device="cuda")
    scale[(1,)](x, 100, FACTOR=2)  # during startup: not counted
    watch.serving = True
    with caplog.at_level(logging.WARNING, logger="rayinfer.workers.kernel_compiles"):
        scale[(1,)](x, 100, FACTOR=2)  # cached in the process: no compile
        scale[(1,)](x, 100, FACTOR=3)  # a new constexpr: compiled
    torch.cuda.synchronize()
    assert x[0].item() == 12.0
    assert watch.num_after_startup == 1 and watch.seconds_after_startup > 0
    [record] = caplog.records
    message = record.getMessage()  # the kernel's qualified name: this test's local `scale`
    assert message.startswith("compiled Triton kernel ") and "scale in " in message
