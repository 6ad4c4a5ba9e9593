"""FP8 settings are refused at start on GPUs without FP8 tensor cores (compute capability below
8.9: A100, A10, RTX 30xx), naming the setting, the GPU's capability and what to use instead;
Ada, Hopper and CPUs (the torch references) pass. The GPU's capability is what torch reports."""

import pytest
import torch

from rayinfer.config_error import ConfigError
from rayinfer.kernels.fp8.fp8_support import require_fp8_device


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_ampere_is_refused_naming_the_setting_and_the_way_out(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with pytest.raises(ConfigError) as refused:
        require_fp8_device(torch.device("cuda", 1), "fp8_weights=true", "use fp8_weights=false")
    message = str(refused.value)
    assert message.startswith("fp8_weights=true needs a GPU of compute capability 8.9")
    assert f"cuda:1 is {capability[0]}.{capability[1]}" in message
    assert message.endswith("use fp8_weights=false")


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_ada_hopper_and_later_pass(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    require_fp8_device(torch.device("cuda", 0), "fp8_weights=true", "use fp8_weights=false")


def test_cpus_pass_without_asking_cuda(monkeypatch):
    def no_cuda(device=None):
        raise AssertionError("a CPU device must not query CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    require_fp8_device(torch.device("cpu"), "fp8_weights=true", "use fp8_weights=false")
