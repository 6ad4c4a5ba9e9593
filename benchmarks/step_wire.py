"""What a worker group's decode step costs to send on the host: the requests as sent
(`SentState.as_sent`, workers/step_wire.py), pickled and unpickled as Ray does, and completed on
the worker (`Worker._complete_requests`), for 256 decodes with 512-block tables and sampling
params, with each request's SamplingParams sent once (today) against sent every step (before),
medians of 30 alternating runs on this CPU.

    python benchmarks/step_wire.py [--batch 256] [--blocks 512]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.engine.batch import ModelBatch, ScheduledRequest  # noqa: E402
from rayinfer.engine.sampling_params import SamplingParams  # noqa: E402
from rayinfer.workers.step_wire import SentState  # noqa: E402
from rayinfer.workers.worker import Worker  # noqa: E402


def step_seconds(requests, params_once: bool) -> float:
    """One later decode step's trip, after a first step that sent everything."""
    sent = SentState()
    worker = SimpleNamespace(block_tables={}, window_tables={}, params={})
    first = ModelBatch(sent.as_sent(0, requests))
    Worker._complete_requests(worker, pickle.loads(pickle.dumps(first)))
    if not params_once:
        sent.params.clear()
    start = time.perf_counter()
    batch = pickle.loads(pickle.dumps(ModelBatch(sent.as_sent(0, requests))))
    Worker._complete_requests(worker, batch)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=512)
    args = parser.parse_args(argv)
    requests = [
        ScheduledRequest(f"r{i}", [7], args.blocks * 16 - 1,
                         list(range(i * 600, i * 600 + args.blocks)), True,
                         SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9))
        for i in range(args.batch)
    ]  # fmt: skip
    times = {True: [], False: []}
    for _ in range(30):
        for once in (False, True):
            times[once].append(step_seconds(requests, once))
    once, every = (statistics.median(times[k]) * 1e3 for k in (True, False))
    print(f"{args.batch} decodes: params once {once:.2f} ms, every step {every:.2f} ms "
          f"({every / once:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
