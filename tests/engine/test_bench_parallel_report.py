"""`python -m rayinfer.bench parallel`'s report line: the rate per GPU, the ratio to the
baseline, and the spread of the timed repeats."""

from rayinfer.bench.parallel import print_run
from rayinfer.config import ParallelPlan


def test_a_prefill_line_shows_the_ratio_and_the_repeats_spread(capsys):
    run = {
        "plan": "dp=2,ep=2", "transport": "host:fp8", "overlap": "on", "graphs": "off",
        "prefill": {16384: 120000.0}, "prefill_run_seconds": {16384: [0.25, 0.31, 0.27]},
        "decode": {}, "graph_capture_s": None, "workers_numa": ["bound to node 0", "one NUMA node"],
    }  # fmt: skip
    print_run(run, ParallelPlan(dp=2, ep=2), 2e9, {16384: 48000.0})
    line = capsys.readouterr().out
    assert "60000/GPU" in line and "1.25x transformers/GPU" in line
    assert "runs 250-310 ms" in line
    assert "workers' NUMA binding: ['bound to node 0', 'one NUMA node']" in line


def test_exchange_flags_name_the_options_they_set():
    import pytest

    from rayinfer.bench.parallel import exchange_options

    assert exchange_options("host:fp8:nolocal") == {
        "transport": "host", "use_fp8": True, "local_first": False,
    }  # fmt: skip
    assert exchange_options("dist:all:local") == {
        "transport": "dist", "dedup": False, "local_first": True,
    }  # fmt: skip
    assert exchange_options("host") == {"transport": "host"}  # local_first left at its default
    with pytest.raises(ValueError, match=r"unknown exchange flags \['fast'\].*nolocal"):
        exchange_options("host:fast")
