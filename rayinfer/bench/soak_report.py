"""What each fault of a soak cost, from the load's outcomes.

A fault's requests are those that ended after its kill and before the next kill (a request in
flight at two kills is the later one's). `recovery_s` is how long after the kill service looked
normal again: the latest end of one of its requests that was in flight at the kill, failed, or
took more than twice the steady phase's P95 latency.
"""

from __future__ import annotations

import statistics

from rayinfer.bench.soak_load import Outcome

STATUSES = ("ok", "error", "lost", "hung")
SLOW_FACTOR = 2.0  # x the steady phase's P95: a request that slow counts as disturbed


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def steady_summary(
    outcomes: list[Outcome], references: list[str], steady_end: float, first_kill: float
) -> dict:
    """The steady phase's requests: sent before it ended, ended before the first kill (one in
    flight at the kill is that fault's)."""
    outcomes = [o for o in outcomes if o.began < steady_end and o.ended <= first_kill]
    latencies = [o.latency_s for o in outcomes if o.status == "ok"]
    return {
        "requests": len(outcomes),
        **{status: sum(o.status == status for o in outcomes) for status in STATUSES},
        "text_differs": sum(o.status == "ok" and o.text != references[o.prompt] for o in outcomes),
        "latency_p50_s": _round(statistics.median(latencies) if latencies else None),
        "latency_p95_s": _round(percentile(latencies, 95)),
    }


def fault_summary(
    fault: dict, outcomes: list[Outcome], references: list[str], next_kill: float, p95_s: float
) -> dict:
    """`fault`: the soak's record of one kill (fault, victim, killed_at, replaced_at)."""
    killed_at = fault["killed_at"]
    mine = [o for o in outcomes if killed_at < o.ended <= next_kill]
    in_flight = [o for o in mine if o.began < killed_at]
    slow_s = SLOW_FACTOR * p95_s
    disturbed = [o for o in mine if o in in_flight or o.status != "ok" or o.latency_s > slow_s]
    recovery_s = max((o.ended - killed_at for o in disturbed), default=0.0)
    failed = [o for o in mine if o.status != "ok"]
    return {
        "fault": fault["fault"],
        "victim": fault["victim"],
        "requests": len(mine),
        "in_flight_at_kill": len(in_flight),
        **{status: sum(o.status == status for o in mine) for status in STATUSES},
        "text_differs": sum(o.status == "ok" and o.text != references[o.prompt] for o in mine),
        "recovery_s": _round(recovery_s),
        "replaced_s": _round(fault["replaced_at"] - killed_at),
        "in_flight_latency_max_s": _round(max((o.latency_s for o in in_flight), default=None)),
        "failures": sorted({f"{o.status}: {o.detail}" for o in failed})[:5],
    }


def memory_summary(before: dict, after: dict) -> dict:
    """Resident bytes and object-store bytes after the quiet period against those before it."""
    rss_before, rss_after = sum(before["rss"].values()), sum(after["rss"].values())
    return {
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_ratio": round(rss_after / rss_before, 3) if rss_before else None,
        "object_store_before_mib": round(before["object_store_bytes"] / 2**20, 2),
        "object_store_after_mib": round(after["object_store_bytes"] / 2**20, 2),
        "objects_before": before["objects"],
        "objects_after": after["objects"],
        "rss_after_by_kind_mib": {k: round(v / 2**20, 1) for k, v in sorted(after["rss"].items())},
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def table(faults: list[dict]) -> str:
    columns = ("fault", "requests", "in_flight_at_kill", "ok", "error", "lost", "hung",
               "text_differs", "recovery_s", "replaced_s")  # fmt: skip
    rows = [columns] + [tuple(str(f[c]) for c in columns) for f in faults]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows)
