"""The interpreter's bounds check (tests/interpreter_bounds.py) on a kernel that reads and writes
one block of a tensor: masked lanes past the end are fine, unmasked ones fail the launch."""

import pytest
import torch
import triton
import triton.language as tl
from interpreter_bounds import OutOfBounds


@triton.jit
def _copy_block(src_ptr, dst_ptr, n, shift, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK) + shift
    mask = offs < n if MASKED else offs >= 0
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def test_masked_lanes_past_the_end_pass():
    src, dst = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    _copy_block[(1,)](src, dst, 10, 0, MASKED=True, BLOCK=16)
    assert torch.equal(src, dst)


@pytest.mark.parametrize("shift", [4, -2])  # lanes 4..19 and -2..13 of a 16-float storage
def test_unmasked_lanes_past_either_end_fail_naming_the_kernel(shift):
    src, dst = torch.arange(16, dtype=torch.float32)[:10], torch.zeros(10)
    with pytest.raises(Exception) as error:
        _copy_block[(1,)](src, dst, 10, shift, MASKED=False, BLOCK=16)
    assert isinstance(error.value.__cause__, OutOfBounds) or "OutOfBounds" in str(error.value)
    assert "_copy_block" in str(error.value) and "outside every tensor argument" in str(error.value)
