"""Where a profiled step's time goes on the GPU: compute, copies, their overlap, and idle gaps.

Reads the Chrome traces that `LLM.start_profile/stop_profile` (or `python -m rayinfer.bench
parallel --profile-dir DIR`) writes, one per worker, and prints per trace:

- span: first GPU activity to last (the profiled step);
- kernels: time at least one kernel runs (union over streams), and how much of it has kernels on
  two or more streams at once (the two-batch-overlap lanes running together);
- copies: time at least one memcpy/memset runs, and how much of it no kernel hides;
- idle: time with nothing at all on the GPU;
- host syncs: host time blocked in stream/device/event synchronize calls, and where: the
  innermost host operator (and, in a trace taken with process.profile_cpu="stack", the innermost
  Python frame) around each;
- busiest streams by kernel and copy time;
- device memory calls (cudaMalloc / cudaFree ...): calls and host time, by name;
- idle by cause: each gap with nothing on the GPU is charged to the host when the work that
  ends it was launched (its runtime call, matched by correlation id) after the gap began: the GPU
  waited for the host to queue it (a host-bound step); else to a dependency (the work was queued
  but waited, e.g. for another stream, a peer's flag or an event).

    python benchmarks/trace_overlap.py DIR/*.json [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path

COPY_CATEGORIES = {"gpu_memcpy", "gpu_memset"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# Device memory calls: cudaFree (and cudaMalloc when memory is short) wait for the whole device;
# PyTorch's caching allocator makes them only when its cache cannot serve a request.
MEMORY_CALLS = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def covered_by_at_least(intervals: list[tuple[float, float]], depth: int) -> float:
    """Length of time at least `depth` intervals overlap."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    total, active, last = 0.0, 0, None
    for time, step in edges:
        if last is not None and active >= depth:
            total += time - last
        active += step
        last = time
    return total


def innermost(enclosing: list[tuple[float, float, str]], start: float, end: float) -> str | None:
    """The name of the shortest interval of `enclosing` that holds [start, end]."""
    holding = [(e - s, name) for s, e, name in enclosing if s <= start and end <= e]
    return min(holding)[1] if holding else None


def where_syncs_wait(syncs, host_events) -> dict[str, dict]:
    """{kind: {innermost enclosing name: [calls, ms]}} for kind "operator" and "python"."""
    places: dict[str, dict] = {"operator": {}, "python": {}}
    for start, end, thread in syncs:
        for kind, by_thread in host_events.items():
            name = innermost(by_thread.get(thread, []), start, end) or "(none)"
            calls_ms = places[kind].setdefault(name, [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += (end - start) * 1e-3
    return {kind: dict(sorted(v.items(), key=lambda kv: -kv[1][1])[:8]) for kind, v in
            places.items() if v and set(v) != {"(none)"}}  # fmt: skip


def idle_by_cause(device_work, launched_at: dict) -> dict[str, float]:
    """Gaps with nothing on the GPU (ms), by what ended them: "host" when the work after the
    gap was launched after the gap began, "dependency" when it was queued already, "unknown"
    when its launch is not in the trace."""
    causes = {"host": 0.0, "dependency": 0.0, "unknown": 0.0}
    busy_until = float("-inf")
    for start, end, correlation in sorted(device_work):
        if start > busy_until > float("-inf"):
            launch_end = launched_at.get(correlation)
            if launch_end is None:
                cause = "unknown"
            else:
                cause = "host" if launch_end > busy_until else "dependency"
            causes[cause] += (start - busy_until) * 1e-3
        busy_until = max(busy_until, end)
    return causes


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def exposed_copies(copies, kernels) -> dict[str, list]:
    """Copy time with no kernel running beside it, by copy stream and transfer size (MB): a
    two-batch-overlap lane's channel has its own streams, and dispatch and combine move blocks of
    different sizes, so the key tells which exchange the compute did not hide. -> {key: [copies,
    exposed ms]}, most exposed first (two copies exposed at once both count)."""
    union = merged(kernels)
    starts = [start for start, _ in union]
    found: dict[str, list] = {}
    for start, end, stream, num_bytes in copies:
        hidden = 0.0
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(union) and union[i][0] < end:
            hidden += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
            i += 1
        key = f"stream {stream}, {num_bytes / 1e6:.1f} MB"
        entry = found.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += (end - start - hidden) * 1e-3
    return dict(sorted(found.items(), key=lambda kv: -kv[1][1]))


def host_self_time(calls: dict, top: int = 12) -> dict[str, list]:
    """calls: thread -> [(start, end, name)] host operators and CUDA runtime/driver calls. Each
    name's calls and self time (its duration less its nested calls' on the same thread), ms,
    most first: where the host spends a step that it queues no faster than the GPU runs it."""
    found: dict[str, list] = {}
    for events in calls.values():
        stack: list[list] = []  # [end, name, child time]
        for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
            while stack and stack[-1][0] <= start:
                _finish(stack.pop(), found)
            if stack:
                stack[-1][2] += end - start
            stack.append([end, name, 0.0, start])
        while stack:
            _finish(stack.pop(), found)
    ranked = sorted(found.items(), key=lambda kv: -kv[1][1])[:top]
    return {name: [count, ms] for name, (count, ms) in ranked}


def _finish(frame: list, found: dict) -> None:
    end, name, children, start = frame
    entry = found.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += max(0.0, end - start - children) * 1e-3


def summarize(trace_path: Path) -> dict:
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    kernels, copies, syncs, sync_calls = [], [], 0.0, []
    copy_details = []  # (start, end, stream, bytes)
    host_calls: dict[tuple, list] = defaultdict(list)  # thread -> operators and CUDA API calls
    memory_calls: dict[str, list] = {}
    device_work: list[tuple[float, float, int | None]] = []  # kernels and copies
    launched_at: dict[int, float] = {}  # correlation id -> end of its runtime call
    host_events = {"operator": defaultdict(list), "python": defaultdict(list)}
    per_stream: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
        category = event.get("cat", "")
        thread = (event.get("pid"), event.get("tid"))
        correlation = event.get("args", {}).get("correlation")
        if category in ("cpu_op", "cuda_runtime", "cuda_driver"):
            host_calls[thread].append((start, end, event.get("name", "?")))
        if category == "kernel":
            kernels.append((start, end))
            device_work.append((start, end, correlation))
        elif category in COPY_CATEGORIES:
            copies.append((start, end))
            device_work.append((start, end, correlation))
            args = event.get("args", {})
            copy_details.append((start, end, args.get("stream", "?"), args.get("bytes", 0)))
        elif (
            category == "cuda_runtime"
            and correlation is not None
            and ("aunch" in event["name"] or "Memcpy" in event["name"])
        ):
            launched_at[correlation] = end  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync
            continue
        elif category == "cuda_runtime" and event.get("name", "").startswith(SYNC_CALLS):
            syncs += end - start
            sync_calls.append((start, end, thread))
            continue
        elif category == "cuda_runtime" and event.get("name", "").startswith(MEMORY_CALLS):
            calls_ms = memory_calls.setdefault(event["name"], [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += (end - start) * 1e-3
            continue
        elif category in ("cpu_op", "python_function"):
            kind = "operator" if category == "cpu_op" else "python"
            host_events[kind][thread].append((start, end, event.get("name", "?")))
            continue
        else:
            continue
        stream = event.get("args", {}).get("stream", "?")
        per_stream[f"{category} stream {stream}"] += end - start
    gpu = kernels + copies
    if not gpu:
        return {"trace": trace_path.name, "error": "no GPU events"}
    span = max(e for _, e in gpu) - min(s for s, _ in gpu)
    kernel_time, copy_time = union_length(kernels), union_length(copies)
    busy = union_length(gpu)
    ms = 1e-3
    return {
        "trace": trace_path.name,
        "span_ms": span * ms,
        "kernels_ms": kernel_time * ms,
        "kernels_on_two_streams_ms": covered_by_at_least(kernels, 2) * ms,
        "copies_ms": copy_time * ms,
        "copies_not_hidden_ms": (busy - kernel_time) * ms,
        "idle_ms": (span - busy) * ms,
        "host_sync_ms": syncs * ms,
        "streams_ms": {k: v * ms for k, v in sorted(per_stream.items(), key=lambda kv: -kv[1])[:6]},
        "host_syncs_in": where_syncs_wait(sync_calls, host_events),
        "memory_calls": memory_calls,
        "idle_by_cause_ms": idle_by_cause(device_work, launched_at),
        "copies_not_hidden_by": exposed_copies(copy_details, kernels),
        "host_self_ms": host_self_time(host_calls),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = [summarize(Path(path)) for path in args.traces]
    for row in rows:
        if "error" in row:
            print(f"{row['trace']}: {row['error']}")
            continue
        print(
            f"{row['trace']}: span {row['span_ms']:.1f} ms | kernels {row['kernels_ms']:.1f} "
            f"(two streams at once {row['kernels_on_two_streams_ms']:.1f}) | copies "
            f"{row['copies_ms']:.1f} (not hidden {row['copies_not_hidden_ms']:.1f}) | idle "
            f"{row['idle_ms']:.1f} | host syncs {row['host_sync_ms']:.1f}"
        )
        for stream, busy_ms in row["streams_ms"].items():
            print(f"    {stream}: {busy_ms:.1f} ms")
        for kind, places in row["host_syncs_in"].items():
            for name, (calls, waited_ms) in places.items():
                print(f"    host sync in {kind} {name}: {calls} calls, {waited_ms:.1f} ms")
        causes = row["idle_by_cause_ms"]
        print("    idle waiting for: " + ", ".join(f"{k} {v:.1f} ms" for k, v in causes.items()))
        for key, (count, exposed_ms) in list(row["copies_not_hidden_by"].items())[:8]:
            print(f"    copies not hidden, {key}: {count} copies, {exposed_ms:.1f} ms")
        for name, (count, self_ms) in row["host_self_ms"].items():
            print(f"    host self time, {name}: {count} calls, {self_ms:.1f} ms")
        for name, (calls, spent_ms) in row["memory_calls"].items():
            print(f"    {name}: {calls} calls, {spent_ms:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
