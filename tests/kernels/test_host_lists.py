"""device_ints: host ints as a device tensor of the asked dtype (on CPU, a plain copy)."""

import torch

from rayinfer.kernels.host_lists import device_ints


def test_lists_and_host_tensors_become_tensors_of_the_dtype():
    out = device_ints([0, 3, 7], torch.int32, torch.device("cpu"))
    assert out.dtype == torch.int32 and out.tolist() == [0, 3, 7]
    rows = device_ints(torch.arange(4), torch.int64, "cpu")
    assert rows.dtype == torch.int64 and rows.tolist() == [0, 1, 2, 3]
    assert device_ints([], torch.int64, "cpu").shape == (0,)
