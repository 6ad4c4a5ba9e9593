"""The soak's bookkeeping (rayinfer/bench/soak_*.py): which fault a request is charged to, what
counts as recovered, the memory of a real cluster's processes by kind, and its option errors."""

from __future__ import annotations

import pytest

from rayinfer.bench import soak_faults, soak_memory, soak_report
from rayinfer.bench.soak_load import Outcome

REFERENCES = ["alpha", "beta"]


def outcome(began: float, ended: float, status: str = "ok", text: str = "alpha") -> Outcome:
    return Outcome(0, True, status, "200" if status == "ok" else "cut", text, began, ended)


def test_a_request_is_charged_to_the_last_kill_before_its_end():
    outcomes = [
        outcome(0.0, 9.0),  # ended before the kill: the steady phase's
        outcome(9.5, 12.0),  # in flight at the kill at 10
        outcome(11.0, 13.0, status="lost", text=""),
        outcome(12.0, 14.0, text="gamma"),  # answered, but not the quiet run's text
        outcome(19.0, 21.0),  # in flight at the next kill (20): the next fault's
    ]
    record = {"fault": "decode-replica", "victim": "v", "killed_at": 10.0, "replaced_at": 15.0}
    summary = soak_report.fault_summary(record, outcomes, REFERENCES, next_kill=20.0, p95_s=5.0)
    assert summary["requests"] == 3 and summary["in_flight_at_kill"] == 1
    assert (summary["ok"], summary["lost"], summary["text_differs"]) == (2, 1, 1)
    assert summary["recovery_s"] == 3.0  # the lost request's end; the in-flight one ended at 12
    assert summary["replaced_s"] == 5.0
    assert summary["failures"] == ["lost: cut"]


def test_the_steady_phase_leaves_out_what_the_first_kill_caught():
    outcomes = [outcome(0.0, 4.0), outcome(3.0, 7.0), outcome(9.0, 12.0, status="lost", text="")]
    steady = soak_report.steady_summary(outcomes, REFERENCES, steady_end=10.0, first_kill=11.0)
    assert (steady["requests"], steady["ok"], steady["lost"]) == (2, 2, 0)
    assert steady["latency_p50_s"] == 4.0


def test_a_request_slower_than_twice_the_steady_p95_delays_recovery():
    outcomes = [outcome(9.0, 11.0), outcome(11.0, 13.0), outcome(12.0, 18.5)]
    record = {"fault": "prefill-worker", "victim": "v", "killed_at": 10.0, "replaced_at": 12.0}
    summary = soak_report.fault_summary(record, outcomes, REFERENCES, float("inf"), p95_s=3.0)
    assert summary["recovery_s"] == 8.5  # 6.5 s > 2 x 3 s: service was not normal until 18.5


def test_growth_is_the_least_squares_slope_per_kind():
    mib = 2**20
    samples = [(t, {"gcs": int(10 * mib + t / 60 * 4 * mib), "raylet": 5 * mib}) for t in
               (0, 60, 120, 180)]  # fmt: skip
    slopes = soak_memory.growth_mib_per_min(samples)
    assert slopes["gcs"] == pytest.approx(4.0, abs=0.01)
    assert slopes["raylet"] == 0 and slopes["total"] == pytest.approx(4.0, abs=0.01)


@pytest.mark.parametrize(
    "argv, kind",
    [
        (["/usr/bin/raylet", "--session_dir=/s"], "raylet"),
        (["/x/gcs_server", "--log_dir=/s/logs"], "gcs"),
        (["ray::ServeReplica:default:Decode.handle_request_streaming"], "replica:Decode"),
        (["ray::ServeController.listen_for_change"], "serve"),
        (["ray::Worker.execute"], "worker"),
        (["ray::IDLE"], "ray-other"),
        (["python", "/ray/dashboard/agent.py", "--session-dir=/s"], "dashboard"),
    ],
)
def test_process_kinds(argv, kind):
    assert soak_memory.process_kind(argv, "/s") == kind


def test_a_real_clusters_processes_are_found_by_kind(ray_cluster):
    session_dir = ray_cluster._private.worker.global_worker.node.get_session_dir_path()
    kinds = soak_memory.rss_by_kind(session_dir, exclude_pids=set())
    assert kinds["gcs"] > 0 and kinds["raylet"] > 0
    assert soak_memory.rss_by_kind("/no/such/session", exclude_pids=set()) == {}
    used, objects = soak_memory.object_store_bytes()
    assert used >= 0 and objects >= 0


def test_an_unknown_fault_names_the_valid_ones():
    assert soak_faults.parse_faults("decode-worker, ingress-replica") == [
        "decode-worker",
        "ingress-replica",
    ]
    assert soak_faults.parse_faults("") == []
    with pytest.raises(ValueError, match="ingress-worker.*valid: prefill-worker, prefill-replica"):
        soak_faults.parse_faults("ingress-worker")
