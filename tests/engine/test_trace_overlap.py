"""benchmarks/trace_overlap.py on a hand-made Chrome trace: what it reports is what the events
say (kernels on two streams overlapping, a copy partly under a kernel, a gap, a host sync with
the operator and Python frame it waited in, a device memory call)."""

import json
from pathlib import Path

from tests.benchmark_scripts import load_benchmark


def event(cat, start, dur, stream=7, name="k", correlation=None):
    args = {"stream": stream, "correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": args}


def test_summary_of_a_small_trace(tmp_path):
    trace = tmp_path / "step.json"
    events = [
        event("kernel", 0, 100),  # 0-100 stream 7
        event("kernel", 50, 100, stream=9),  # 50-150 stream 9: 50 us on two streams
        event("gpu_memcpy", 120, 60, stream=11),  # 120-180: 30 us with no kernel beside it
        event("kernel", 200, 50, correlation=5),  # 180-200 idle: launched at 190, the host's
        event("cuda_runtime", 185, 5, name="cudaLaunchKernel", correlation=5),
        event("cuda_runtime", 10, 40, name="cudaStreamSynchronize"),
        event("cpu_op", 0, 500, name="aten::mm"),  # encloses the sync, not innermost
        event("cpu_op", 5, 60, name="aten::_local_scalar_dense"),  # innermost around the sync
        event("cpu_op", 60, 10, name="aten::add"),  # after it
        event("python_function", 0, 80, name="moe.py(12): route"),
        event("cuda_runtime", 90, 30, name="cudaFree"),
    ]
    trace.write_text(json.dumps({"traceEvents": events}))
    row = load_benchmark("trace_overlap").summarize(trace)
    assert row["span_ms"] * 1e3 == 250
    assert round(row["kernels_ms"] * 1e3) == 200
    assert round(row["kernels_on_two_streams_ms"] * 1e3) == 50
    assert round(row["copies_ms"] * 1e3) == 60 and round(row["copies_not_hidden_ms"] * 1e3) == 30
    assert round(row["idle_ms"] * 1e3) == 20
    assert round(row["host_sync_ms"] * 1e3) == 40
    assert row["host_syncs_in"] == {
        "operator": {"aten::_local_scalar_dense": [1, 0.04]},
        "python": {"moe.py(12): route": [1, 0.04]},
    }
    assert row["memory_calls"] == {"cudaFree": [1, 0.03]}
    assert row["idle_by_cause_ms"] == {"host": 0.02, "dependency": 0.0, "unknown": 0.0}
    assert row["copies_not_hidden_by"] == {"stream 11, 0.0 MB": [1, 0.03]}


def test_copies_not_hidden_are_told_apart_by_stream_and_size():
    exposed = load_benchmark("trace_overlap").exposed_copies(
        [(0, 100, 3, 4e6), (150, 250, 3, 8e6), (260, 280, 5, 4e6)],  # (start, end, stream, B)
        [(20, 40), (30, 60), (200, 300)],  # kernels: 20-60 and 200-300 covered
    )
    assert exposed == {"stream 3, 4.0 MB": [1, 0.06], "stream 3, 8.0 MB": [1, 0.05],
                       "stream 5, 4.0 MB": [1, 0.0]}  # fmt: skip


def test_a_gap_before_work_queued_earlier_is_a_dependency(tmp_path):
    trace = tmp_path / "step.json"
    events = [
        event("kernel", 0, 100, correlation=1),
        event("cuda_runtime", 0, 5, name="cudaLaunchKernel", correlation=1),
        event("gpu_memcpy", 130, 20, stream=11, correlation=2),  # queued at 10, waited 100-130
        event("cuda_runtime", 6, 4, name="cudaMemcpyAsync", correlation=2),
    ]
    trace.write_text(json.dumps({"traceEvents": events}))
    row = load_benchmark("trace_overlap").summarize(trace)
    assert row["idle_by_cause_ms"] == {"host": 0.0, "dependency": 0.03, "unknown": 0.0}


def test_the_profiler_switch_for_gpu_activity_only():
    import pytest
    import torch
    from torch.profiler import ProfilerActivity

    from rayinfer.config import ConfigError
    from rayinfer.process_config import ProcessConfig
    from rayinfer.workers.runner.step_profiler import StepProfiler

    # on CPU the host's activity is all there is
    assert StepProfiler(torch.device("cpu"), "none").activities == [ProfilerActivity.CPU]
    expected = r"process\.profile_cpu='no'; use one of ops, none, stack, python"
    with pytest.raises(ConfigError, match=expected):
        ProcessConfig(profile_cpu="no")
    with pytest.raises(ValueError, match=expected):
        StepProfiler(torch.device("cpu"), "no")


def test_host_self_time_leaves_out_nested_calls():
    host = load_benchmark("trace_overlap").host_self_time(
        {("p", 1): [(0, 100, "aten::mm"), (10, 30, "cudaLaunchKernel"),
                    (40, 50, "cudaLaunchKernel"), (200, 210, "aten::add")],
         ("p", 2): [(0, 5, "cudaLaunchKernel")]}
    )  # fmt: skip
    import pytest

    expected = {"aten::mm": [1, 0.07], "cudaLaunchKernel": [3, 0.035], "aten::add": [1, 0.01]}
    assert list(host) == list(expected)  # most self time first
    for name, (count, self_ms) in expected.items():
        assert host[name][0] == count and host[name][1] == pytest.approx(self_ms)


def test_the_python_profile_lists_the_host_functions(monkeypatch, tmp_path):
    import pstats

    import torch

    from rayinfer.workers.runner.step_profiler import StepProfiler

    def queue_work():
        return torch.ones(64).sum()

    profiler = StepProfiler(torch.device("cpu"), "python")
    profiler.start(str(tmp_path / "step"))
    for _ in range(3):
        queue_work()
    table = Path(profiler.stop()).read_text()
    assert "queue_work" in table and "tottime" in table
    stats = pstats.Stats(str(tmp_path / "step.pstats"))
    calls = {name: row[1] for (_, _, name), row in stats.stats.items()}
    assert calls["queue_work"] == 3
