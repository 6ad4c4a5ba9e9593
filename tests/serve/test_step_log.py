"""The replica's step log: decode and prompt steps apart, and a decode step's time split between
the replica and its workers from their step timelines."""

from __future__ import annotations

import logging

import pytest

from rayinfer.deployments.step_log import STEP_LOG_S, StepLog, decode_step_phases

# (start, seconds, prompt tokens): a prompt step, then two decode steps of 10 and 14 ms
STEPS = [(100.0, 0.100, 8192), (100.2, 0.010, 0), (100.3, 0.014, 0)]
TIMELINES = {
    "driver": [  # the group's calls: sent, results back
        {"sent": 100.001, "results": 100.098},
        {"sent": 100.201, "results": 100.209},
        {"sent": 100.302, "results": 100.313},
    ],
    "ranks": [[  # rank 0's runs of them
        {"received": 100.0015, "queued": 100.05, "finished": 100.097, "gpu_ms": 90.0},
        {"received": 100.2015, "queued": 100.203, "finished": 100.2085, "gpu_ms": 6.0},
        {"received": 100.3025, "queued": 100.305, "finished": 100.312, "gpu_ms": 8.0},
    ]],
}  # fmt: skip


def test_decode_phases_pair_each_step_with_its_call_and_run():
    phases = decode_step_phases(STEPS, TIMELINES)
    # the medians of two decode steps (the upper one): engine 14 - 11, send 0.5, host 2.5,
    # wait 7, return 1, gpu 8
    expected = {"engine": 3.0, "send": 0.5, "host": 2.5, "wait": 7.0, "gpu": 8.0, "return": 1.0}
    assert phases == pytest.approx(expected, abs=1e-6)
    assert decode_step_phases(STEPS, {}) == {}  # an executor without timelines


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_line_every_step_log_s_with_both_kinds_and_the_phases():
    # on the logger itself: once ray.serve is imported it no longer propagates to the root
    lines, serve_logger = _Lines(), logging.getLogger("ray.serve")
    level = serve_logger.level
    serve_logger.addHandler(lines)
    serve_logger.setLevel(logging.INFO)
    try:
        log = StepLog("engine", drain_timelines=lambda: TIMELINES)
        log.add(STEPS[:1], log.since + 1)  # within STEP_LOG_S: kept
        assert lines.lines == []
        log.add(STEPS[1:], log.since + STEP_LOG_S)
    finally:
        serve_logger.removeHandler(lines)
        serve_logger.setLevel(level)
    assert lines.lines == [
        "engine steps in 10 s: 2 of decodes alone, median 14.0 ms; 1 with prompt tokens, "
        "median 100.0 ms for 8192 tokens; a decode step's ms: engine 3.0, send 0.5, host 2.5, "
        "wait 7.0, gpu 8.0, return 1.0"
    ]
    assert log.steps == []
