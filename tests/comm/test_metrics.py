"""All-to-all metrics: the phase read from a worker group's name, and samples recorded into
Ray's metrics."""

from rayinfer.comm.metrics import AllToAllRecorder, phase_of


def test_phase_comes_from_the_worker_group_name():
    assert phase_of("rayinfer-decode-k3x9q2ab-ep0") == "decode"
    assert phase_of("rayinfer-prefill-abc-tp1") == "prefill"
    assert phase_of("my-group") == "other"


def test_recorder_records_inside_ray(ray_cluster):
    recorder = AllToAllRecorder("rayinfer-decode-x-ep0")
    assert recorder.enabled
    recorder.record("pairwise", "host", 1024, 1e-3)
    # a rank whose tokens all stay local sends 0 bytes: Counter.inc(0) would raise
    recorder.record("pairwise", "dist", 0, 1e-3)
    assert recorder.tags("pairwise", "host") == {
        "phase": "decode",
        "schedule": "pairwise",
        "transport": "host",
    }
    recorder.flush()  # into Ray's real Counter and Histogram
    assert len(recorder._samples) == 0
