"""freeze_after_startup: only on CUDA devices, only while switched on, and a bad switch names
itself and its values."""

import gc

import pytest
import torch

from rayinfer.workers.gc_freeze import GC_FREEZE_ENV, freeze_after_startup


def test_cpu_processes_keep_the_collector_as_it_is(monkeypatch):
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    frozen = gc.get_freeze_count()
    assert not freeze_after_startup(torch.device("cpu"))
    assert gc.get_freeze_count() == frozen


def test_switched_off_it_leaves_a_cuda_process_alone(monkeypatch):
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    assert not freeze_after_startup(torch.device("cuda"))


def test_a_bad_switch(monkeypatch):
    monkeypatch.setenv(GC_FREEZE_ENV, "yes")
    with pytest.raises(ValueError, match="RAYINFER_GC_FREEZE='yes'.*1.*0"):
        freeze_after_startup(torch.device("cpu"))
