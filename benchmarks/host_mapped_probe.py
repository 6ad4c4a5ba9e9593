"""What one GPU's programs can move through page-locked host memory (the mailbox kernel's
medium), against the copy engines, on one GPU:

- copy engines: cudaMemcpyAsync device -> pinned host and back (torch copy_, CUDA events);
- the mailbox kernel in loopback (a rank's own mailbox: its sending programs store the block
  into host memory, its receiving programs poll the flags and load it back), over programs per
  direction, words per program step and warps;
- host time to queue one launch through Triton's launcher.

    python benchmarks/host_mapped_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.kernels.comm.host_mailbox import MailboxSide, host_mailbox_exchange  # noqa: E402

SIZES = (917_504, 7_340_032)  # 64 and 512 tokens of 7168 bf16


def _events_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_engines(size: int) -> dict:
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    d2h = _events_us(lambda: host.copy_(dev, non_blocking=True))
    h2d = _events_us(lambda: dev.copy_(host, non_blocking=True))
    return dict(d2h_us=d2h, h2d_us=h2d, d2h_gbs=size / d2h / 1e3, h2d_gbs=size / h2d / 1e3)


class Loopback:
    def __init__(self, box_bytes: int, slices: int):
        self.box = torch.zeros(2 * box_bytes, dtype=torch.uint8, pin_memory=True)
        self.words = torch.zeros(2 * slices, dtype=torch.int32, pin_memory=True)
        self.epochs = torch.zeros(2, slices, dtype=torch.int32, device="cuda")
        self.box_bytes, self.slices = box_bytes, slices

    def run(self, src, dst, block_words: int, warps: int, **protocol) -> None:
        flags, acks = self.words[: self.slices], self.words[self.slices :]
        send = MailboxSide(src, self.box, flags, acks, self.epochs[0])
        recv = MailboxSide(dst, self.box, flags, acks, self.epochs[1])
        host_mailbox_exchange(
            send, recv, self.box_bytes, self.slices, block_words, warps, **protocol
        )


# (One thread per program polls and releases; every thread polling and fencing measured
# 2.5-3x slower here, so the kernel has only the one-thread form.)
PROTOCOLS = {
    "leader": dict(),
    "leader-plain-loads": dict(volatile_data=False),
    "leader-nap200": dict(backoff_ns=200),
    "leader-nap200-plain": dict(backoff_ns=200, volatile_data=False),
}


def mailbox_loopback(size: int) -> list[dict]:
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    rows = []
    for slices in (16, 32, 64, 128):
        box = Loopback(size, slices)
        for block_words in (1024, 4096):
            for name, protocol in PROTOCOLS.items():
                dst.zero_()
                run = functools.partial(box.run, src, dst, block_words, 4, **protocol)
                run()
                torch.cuda.synchronize()
                exact = bool(torch.equal(dst, src))
                us = _events_us(run)
                rows.append(
                    dict(size=size, slices=slices, block_words=block_words, protocol=name,
                         exact=exact, us=us, gbs_each_way=size / us / 1e3)
                )  # fmt: skip
    return rows


def launch_host_us() -> float:
    src = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    box = Loopback(4096, 64)
    box.run(src, src.clone(), 1024, 4)
    torch.cuda.synchronize()
    dst = src.clone()
    start = time.perf_counter()
    for _ in range(200):
        box.run(src, dst, 1024, 4)
    elapsed = (time.perf_counter() - start) / 200 * 1e6
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    report = dict(
        copy_engines={size: copy_engines(size) for size in SIZES},
        loopback=[row for size in SIZES for row in mailbox_loopback(size)],
        launch_host_us=launch_host_us(),
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host_mapped_probe.json").write_text(json.dumps(report, indent=1))
    print("copy engines", json.dumps(report["copy_engines"]))
    print("launch host us", round(report["launch_host_us"], 1))
    for size in SIZES:
        rows = [r for r in report["loopback"] if r["size"] == size]
        for r in sorted(rows, key=lambda r: r["us"])[:8]:
            print(r)
        for name in PROTOCOLS:
            best = min((r for r in rows if r["protocol"] == name), key=lambda r: r["us"])
            print("best of", name, round(best["us"], 1), best["slices"], best["block_words"])
        print("all exact", all(r["exact"] for r in rows))


if __name__ == "__main__":
    main()
