"""All-to-all metrics: the phase read from a worker group's name, and a recorded exchange."""

import torch

from rayinfer.comm.metrics import AllToAllTimer, phase_of


def test_phase_comes_from_the_worker_group_name():
    assert phase_of("rayinfer-decode-k3x9q2ab-ep0") == "decode"
    assert phase_of("rayinfer-prefill-abc-tp1") == "prefill"
    assert phase_of("my-group") == "other"


def test_timer_records_inside_ray(ray_cluster):
    with AllToAllTimer("rayinfer-decode-x-ep0", 1024, "pairwise", "host") as timer:
        torch.zeros(8).sum()
    assert timer.num_bytes == 1024
    assert timer.tags == {"phase": "decode", "schedule": "pairwise", "transport": "host"}


def test_timer_accepts_an_exchange_that_sends_nothing(ray_cluster):
    with AllToAllTimer("rayinfer-decode-x-ep0", 0, "pairwise", "dist"):
        pass  # a rank whose tokens all stay local: Counter.inc(0) would raise


def test_timer_skips_a_failed_exchange(ray_cluster):
    try:
        with AllToAllTimer("rayinfer-decode-x-ep0", 1024, "nccl", "dist"):
            raise RuntimeError("exchange failed")
    except RuntimeError:
        pass
