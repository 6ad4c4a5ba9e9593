"""KV hand-off through the Ray object store: a payload of torch tensors (pickled) against the same
bytes as uint8 numpy arrays (stored out of band, read back without a copy), in the same run.

    python benchmarks/object_store_payload.py [--megabytes 256] [--layers 27] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import ray
import torch

from rayinfer.workers.runner.kv_transfer import KVPayload


def timed_median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    per_layer = args.megabytes * (1 << 20) // args.layers // 2  # bf16 values per layer
    layers = [torch.randn(per_layer // 576, 576).to(torch.bfloat16) for _ in range(args.layers)]
    candidates = {
        "torch tensors (pickled)": layers,
        "KVPayload (numpy uint8)": KVPayload.from_tensors(layers, generator_state=None),
    }
    results = {}
    for name, payload in candidates.items():
        ref = ray.put(payload)
        put_s = timed_median(lambda p=payload: ray.put(p), args.repeats)
        get_s = timed_median(lambda r=ref: ray.get(r), args.repeats)
        results[name] = (put_s, get_s)
        print(f"{name:26s} put {put_s * 1e3:8.1f} ms   get {get_s * 1e3:8.1f} ms")
    (base_put, base_get), (ours_put, ours_get) = results.values()
    print(f"speed-up: put {base_put / ours_put:.1f}x, get {base_get / ours_get:.1f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
