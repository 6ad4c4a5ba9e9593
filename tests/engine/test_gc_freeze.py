"""freeze_after_startup: only on CUDA devices, only while switched on; ProcessConfig checks the
switch, naming itself and its values."""

import gc

import pytest
import torch

from rayinfer.config import ConfigError
from rayinfer.process_config import ProcessConfig
from rayinfer.workers.gc_freeze import freeze_after_startup


def test_cpu_processes_keep_the_collector_as_it_is():
    frozen = gc.get_freeze_count()
    assert not freeze_after_startup(torch.device("cpu"))
    assert gc.get_freeze_count() == frozen


def test_switched_off_it_leaves_a_cuda_process_alone():
    assert not freeze_after_startup(torch.device("cuda"), enabled=False)


def test_a_bad_switch():
    with pytest.raises(ConfigError, match=r"process\.gc_freeze='yes'; use one of True, False"):
        ProcessConfig(gc_freeze="yes")
