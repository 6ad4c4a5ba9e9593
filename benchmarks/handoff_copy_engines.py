"""The KV hand-off's copies between page-locked host memory and the paged cache, with the GPU
idle and busy, three ways: one host <-> device copy of the chunk through a device staging buffer
with a gather or scatter per layer ("per layer", torch index ops) or one kernel for all layers
("one kernel": workers/runner/kv_copy.py, kernels/cache_rows.py); and batched row copies the
copy engines carry out without a kernel ("direct": workers/runner/copy_batches.py), one per
layer and run of consecutive slots (KVCopier takes them where the runs are long enough:
kv_copy.DIRECT_MIN_COPY_BYTES).

"busy, this process": matmuls queued on another stream of this process ahead of each copy (as a
decode step beside an import), "+ a Python thread" adds a thread spinning in Python (holding the
GIL as an engine loop's host work does), once per `--switch-intervals-ms` (the interpreter's GIL
switch interval, ProcessConfig.gil_switch_interval_ms; Python's own is 5 ms); "busy, another
process": a second process running
matmuls throughout (as Prefill and Decode replicas sharing one GPU). One V2-Lite request by
default (3,700 tokens x 27 layers x 1,152 bytes, 115 MB), its blocks in order, in runs of 8, 4
and 2, and shuffled; each way is checked byte for byte first. Wall time per copy (what the
hand-off waits), medians:

    python benchmarks/handoff_copy_engines.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import sys
import threading
import time
from functools import partial

import numpy as np
import torch

from rayinfer.kernels.cache_rows import cache_rows_reference
from rayinfer.workers.runner.copy_batches import RowCopies, batch_copies_available
from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import layer_rows, token_slots


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--row-bytes", type=int, default=1152)
    parser.add_argument("--tokens", type=int, default=3700)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--busy-ms", type=float, default=40.0, help="matmul work queued per copy")
    parser.add_argument(
        "--switch-intervals-ms",
        type=float,
        nargs="+",
        default=[5.0],
        help="GIL switch intervals for the Python-thread rows",
    )
    parser.add_argument(
        "--tables",
        nargs="+",
        default=None,
        help="only these block layouts (e.g. 'in order', 'shuffled')",
    )
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def matmul_loop(stop, ready) -> None:
    """Another process keeping the GPU's SMs busy until `stop` is set."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ready.set()
    while not stop.is_set():
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()


class Busy:
    """Matmuls on a side stream of this process, about `ms` milliseconds of them per call."""

    def __init__(self, ms: float):
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.a @ self.b
            start.record()
            for _ in range(4):
                self.a @ self.b
            end.record()
        end.synchronize()
        self.count = max(1, round(ms / (start.elapsed_time(end) / 4)))

    def queue(self) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(self.count):
                self.a @ self.b

    def wait(self) -> None:
        self.stream.synchronize()


def timed(copy, repeats: int, busy: Busy | None) -> float:
    """Median wall milliseconds of copy() (which returns once its copies have ended)."""
    times = []
    for _ in range(repeats):
        if busy is not None:
            busy.queue()
            time.sleep(0.002)  # the matmuls have started
        begin = time.perf_counter()
        copy()
        times.append(1e3 * (time.perf_counter() - begin))
        if busy is not None:
            busy.wait()
    return statistics.median(times)


class PythonThread:
    """A thread spinning in Python while it runs (contends for the GIL)."""

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        return self

    def _spin(self) -> None:
        total = 0
        while not self.stop.is_set():
            total += sum(range(1000))

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


class Ways:
    """The three ways of one request's copies (see the module's docstring)."""

    def __init__(self, caches, chunk: torch.Tensor, tokens: int):
        self.copier = KVCopier(caches)
        self.copier._row_copies = None  # always staged with one kernel
        # one chunk, as the arena holds a request
        self.copier.chunk_tokens = max(self.copier.chunk_tokens, tokens)
        self.chunk = chunk
        self.host_rows = layer_rows(chunk, self.copier.layer_bytes)
        self.direct = RowCopies(self.copier.rows)
        self.stream = torch.cuda.Stream()

    def per_layer(self, slots: torch.Tensor, to_cache: bool) -> None:
        copier = self.copier
        with torch.cuda.stream(copier._stream):
            device_slots = slots.to("cuda", non_blocking=True)
            staging = copier._device_view(len(slots))
            if to_cache:
                staging.copy_(self.chunk, non_blocking=True)
                cache_rows_reference(copier.rows, staging, device_slots, to_cache=True)
            else:
                cache_rows_reference(copier.rows, staging, device_slots, to_cache=False)
                self.chunk.copy_(staging, non_blocking=True)
        copier._stream.synchronize()

    def one_kernel(self, slots: torch.Tensor, to_cache: bool) -> None:
        if to_cache:
            self.copier.import_(slots, [self.chunk], pinned=True)
        else:
            self.copier.export_into(slots, [self.chunk])

    def run_direct(self, slots: torch.Tensor, to_cache: bool) -> None:
        self.direct.issue(self.host_rows, slots.numpy(), to_cache, self.stream)
        self.stream.synchronize()

    def all(self, slots: torch.Tensor) -> dict:
        ways = {}
        for kind, to_cache in (("import", True), ("export", False)):
            ways[(kind, "per layer")] = partial(self.per_layer, slots, to_cache)
            ways[(kind, "one kernel")] = partial(self.one_kernel, slots, to_cache)
            ways[(kind, "direct")] = partial(self.run_direct, slots, to_cache)
        return ways


def check(ways: Ways, slots: torch.Tensor) -> None:
    """Every way moves the request's bytes exactly, both directions."""
    rows = ways.copier.rows
    device_slots = slots.to("cuda")
    expected = [layer[device_slots].cpu() for layer in rows]
    for (kind, way), copy in ways.all(slots).items():
        if kind == "export":
            ways.chunk.zero_()
            copy()
            got = ways.host_rows
        else:
            ways.copier.export_into(slots, [ways.chunk])
            for layer in rows:
                layer[device_slots] = 0
            copy()
            got = [layer[device_slots].cpu() for layer in rows]
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), f"{kind} {way}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or not batch_copies_available(torch.device("cuda")):
        print("needs a CUDA GPU and a driver with cuMemcpyBatchAsync (CUDA 12.8+)")
        return 0
    shape = (args.num_blocks, args.block_size, args.row_bytes // 2)
    caches = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
    token_bytes = args.layers * args.row_bytes
    chunk = torch.empty(args.tokens * token_bytes, dtype=torch.uint8, pin_memory=True)
    ways = Ways(caches, chunk, args.tokens)
    num_request_blocks = -(-args.tokens // args.block_size)
    generator = np.random.default_rng(0)
    shuffled = generator.permutation(args.num_blocks)[:num_request_blocks].tolist()
    tables = {"blocks in order": list(range(7, 7 + num_request_blocks))}
    for run in (8, 4, 2):
        groups = generator.permutation(args.num_blocks // run)[: -(-num_request_blocks // run)]
        blocks = [run * int(group) + b for group in groups for b in range(run)]
        tables[f"runs of {run} blocks"] = blocks[:num_request_blocks]
    tables["blocks shuffled"] = shuffled
    if args.tables:
        tables = {n: t for n, t in tables.items() if any(k in n for k in args.tables)}
    mbytes = args.tokens * token_bytes / 1e6
    results = {"bytes": args.tokens * token_bytes, "args": vars(args), "rows": []}
    print(f"{mbytes:.1f} MB a request; wall ms (GB/s), medians of {args.repeats}")
    busy_here = Busy(args.busy_ms)
    context = multiprocessing.get_context("spawn")
    spinning_loads = [f"busy, this process + a Python thread, switch {ms:g} ms"
                      for ms in args.switch_intervals_ms]  # fmt: skip
    loads = ("idle", "busy, this process", *spinning_loads, "busy, another process")
    python_interval = sys.getswitchinterval()
    for name, table in tables.items():
        slots = token_slots(table, args.tokens, args.block_size)
        check(ways, slots)
        runs = len(np.flatnonzero(np.diff(slots.numpy()) != 1)) + 1
        for load in loads:
            other, spinning = None, contextlib.nullcontext()
            if load == "busy, another process":
                stop, ready = context.Event(), context.Event()
                other = context.Process(target=matmul_loop, args=(stop, ready))
                other.start()
                if not ready.wait(120):
                    raise RuntimeError("the matmul process did not start")
            elif "Python thread" in load:
                spinning = PythonThread()
                interval = args.switch_intervals_ms[spinning_loads.index(load)]
                sys.setswitchinterval(interval / 1e3)
            busy = busy_here if load.startswith("busy, this process") else None
            try:
                with spinning:
                    for (kind, way), copy in ways.all(slots).items():
                        copy()  # warm
                        ms = timed(copy, args.repeats, busy)
                        row = {"table": name, "runs": runs, "load": load, "copy": kind,
                               "way": way, "ms": ms, "gb_s": mbytes / ms}  # fmt: skip
                        results["rows"].append(row)
                        print(f"{name} ({runs} runs x {args.layers} layers), {load}: {kind} "
                              f"{way} {ms:.2f} ms ({mbytes / ms:.1f} GB/s)")  # fmt: skip
            finally:
                sys.setswitchinterval(python_interval)
                if other is not None:
                    stop.set()
                    other.join(60)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
