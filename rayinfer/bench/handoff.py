"""The KV hand-off's data movement between two Ray actors (prefill -> decode): the same-node
arena path against the object-store path (and the per-layer path before them), in the same run.

    python -m rayinfer.bench handoff [--tokens 3700 --layers 27 --row 576 --dtype bfloat16]
    python -m rayinfer.bench handoff --two-nodes   # also into an importer on another Ray node

Each actor holds a paged cache of `--layers` layers of `--row`-element rows (default: a 3.7k-token
DeepSeek-V2-Lite request, 27 x 576 bf16 = 115 MB) on the GPU (both actors on one GPU, as the
disaggregated server on one GPU runs them) or the CPU, and exports and imports through the
workers' own code (workers/handoff_io.py):
- `shm` (kv_handoff.path=auto): gather into device staging, one device -> host copy per chunk
  into the exporter's page-locked shared-memory arena; the importer maps the arena and copies
  from it straight to the device, then scatters (workers/runner/kv_arena.py). An importer on
  another node asks the exporter to put the span into the object store and pulls it;
- `object-store` (kv_handoff.path=object_store, workers/runner/kv_copy.py): gather into device
  staging, one asynchronous copy per chunk into pinned memory, one object-store put per chunk
  while the next copies; import through pinned memory with a parallel memcpy and one host ->
  device copy per chunk, then a scatter;
- `per-layer` (the path before issue 28): a synchronous `.cpu()` of each layer's rows into
  pageable memory, one put of the list; import with one `.to(device)` per layer.
Times are medians over `--repeats` after one warm-up (which makes and page-locks the arena and
the importer's mapping of it), measured inside the actors: export = copy + put, import = get
(headers, the arena's mapping, or the object-store get) + copy. Every run checks that the
importer's rows equal the exporter's byte for byte.

`--two-nodes` starts a local two-node Ray cluster (`ray.cluster_utils.Cluster`: two raylets, two
object stores on this machine) and runs every path twice in the same run: into an importer on
the exporter's node, then into one on the other node, whose `get` pulls the chunks through Ray's
object manager (over TCP, here the loopback) as a decode replica on another machine does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time

import ray
import torch

from rayinfer.engine_config import KVHandoffConfig
from rayinfer.workers.handoff_io import HandoffIO
from rayinfer.workers.runner.kv_cache import KVCache
from rayinfer.workers.runner.kv_copy import CHUNK_BYTES
from rayinfer.workers.runner.kv_transfer import pack_kv, token_slots

BLOCK_SIZE = 64
# Custom resources that pin the actors of a --two-nodes run to the exporter's node or the other.
NODE_RESOURCES = {"same node": "handoff_exporter_node", "other node": "handoff_other_node"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CacheHolder:
    """One side of the hand-off: a random paged cache and every path's copies over it."""

    def __init__(self, layers: int, row: int, dtype: str, num_blocks: int, seed: int):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        shape = (num_blocks, BLOCK_SIZE, row)
        self.caches = [
            torch.randn(shape, generator=generator, device=self.device).to(DTYPES[dtype])
            for _ in range(layers)
        ]
        self.kv_caches: dict[int, KVCache] = {}  # chunk bytes -> the cache's chunked copies
        is_cuda = self.device.type == "cuda"
        # path -> the worker's hand-off code, as a worker with that kv_handoff.path runs it
        self.handoffs = {
            name: HandoffIO(is_cuda, KVHandoffConfig(path=path))
            for name, path in (("shm", "auto"), ("object-store", "object_store"))
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _cache(self, chunk_bytes: int) -> KVCache:
        if chunk_bytes not in self.kv_caches:
            self.kv_caches[chunk_bytes] = KVCache(self.caches, BLOCK_SIZE, None, chunk_bytes)
        return self.kv_caches[chunk_bytes]

    def export(self, variant: str, table: list[int], num_tokens: int, chunk_bytes: int):
        """The payload (a header naming an arena span, or the chunks' ObjectRefs)."""
        self._sync()
        cache = self._cache(chunk_bytes)
        payload = self.handoffs[variant].export(cache, table, num_tokens, generator_state=None)
        payload.timings["total_s"] = payload.timings["export_s"]
        return payload

    def import_(self, variant: str, shard, table: list[int], chunk_bytes: int) -> dict:
        self._sync()
        cache = self._cache(chunk_bytes)
        timings = self.handoffs[variant].import_(cache, table, [shard]).timings
        return dict(timings, total_s=timings["get_s"] + timings["copy_s"])

    def kv_from_arena(self, header):
        """For an importer on another node (HandoffIO's contract with exporting actors)."""
        return self.handoffs["shm"].kv_from_arena(header)

    def release_arena_span(self, span) -> None:
        self.handoffs["shm"].release_own_span(span)

    def close(self) -> None:
        for handoff in self.handoffs.values():
            handoff.close()

    def export_per_layer(self, table: list[int], num_tokens: int) -> tuple[ray.ObjectRef, dict]:
        self._sync()
        start = time.perf_counter()
        slots = token_slots(table, num_tokens, BLOCK_SIZE)
        layers = pack_kv(self.caches, slots)  # one synchronous .cpu() per layer
        copied = time.perf_counter()
        ref = ray.put([layer.view(torch.uint8).numpy() for layer in layers])
        end = time.perf_counter()
        return [ref], {"copy_s": copied - start, "put_s": end - copied, "total_s": end - start}

    def import_per_layer(self, refs: list, table: list[int], num_tokens: int) -> dict:
        self._sync()
        start = time.perf_counter()
        layers = ray.get(refs[0])
        fetched = time.perf_counter()
        slots = token_slots(table, num_tokens, BLOCK_SIZE).to(self.device)
        for cache, raw in zip(self.caches, layers):
            flat = cache.view(-1, cache.shape[2])
            flat[slots] = (
                torch.from_numpy(raw).view(cache.dtype).view(num_tokens, -1).to(self.device)
            )
        self._sync()
        end = time.perf_counter()
        return {"get_s": fetched - start, "copy_s": end - fetched, "total_s": end - start}

    def digest(self, table: list[int], num_tokens: int) -> str:
        """sha256 of the rows at the request's slots, every layer."""
        rows = pack_kv(self.caches, token_slots(table, num_tokens, BLOCK_SIZE))
        sha = hashlib.sha256()
        for layer in rows:
            sha.update(layer.view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench handoff", description=__doc__)
    parser.add_argument("--tokens", type=int, default=3700)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--row", type=int, default=576, help="elements per token and layer")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--chunk-mb", default=f"{CHUNK_BYTES >> 20}", help="comma-separated chunk sizes (MiB)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--two-nodes",
        action="store_true",
        help="start a local two-node Ray cluster and import on both nodes (same-run baseline)",
    )
    parser.add_argument(
        "--object-store-mb", type=int, default=1024, help="each node's object store (--two-nodes)"
    )
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def run_variant(exporter, importer, name: str, args, export_table, import_table, chunk_bytes):
    samples = []
    for _ in range(args.repeats + 1):  # the first is a warm-up
        if name == "per-layer":
            refs, export = ray.get(exporter.export_per_layer.remote(export_table, args.tokens))
            landed = ray.get(importer.import_per_layer.remote(refs, import_table, args.tokens))
        else:
            shard = exporter.export.remote(name, export_table, args.tokens, chunk_bytes)
            export = ray.get(shard).timings
            landed = ray.get(importer.import_.remote(name, shard, import_table, chunk_bytes))
        samples.append((export, landed))
    exact = ray.get(exporter.digest.remote(export_table, args.tokens)) == ray.get(
        importer.digest.remote(import_table, args.tokens)
    )
    samples = samples[1:]

    def median(side: int, key: str) -> float:
        return statistics.median(sample[side].get(key, 0.0) for sample in samples)

    return {
        "variant": name,
        "chunk_mb": chunk_bytes >> 20 if name != "per-layer" else None,
        "path": samples[-1][1].get("path", "per-layer"),  # how the import's bytes came
        "exact": exact,
        "export_s": median(0, "total_s"),
        "export_copy_s": median(0, "copy_s"),
        "export_put_s": median(0, "put_s"),
        "import_s": median(1, "total_s"),
        "import_get_s": median(1, "get_s"),
        "import_copy_s": median(1, "copy_s"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster, temp_dir = start_two_nodes(args) if args.two_nodes else (None, None)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    num_blocks = 2 * -(-args.tokens // BLOCK_SIZE) + 2
    shape = (args.layers, args.row, args.dtype, num_blocks)
    placements = list(NODE_RESOURCES) if args.two_nodes else ["same node"]
    exporter = holder_on("same node", use_gpu, args.two_nodes).remote(*shape, seed=1)
    used = -(-args.tokens // BLOCK_SIZE)
    export_table = list(range(num_blocks - 1, num_blocks - 1 - used, -1))  # scattered, reversed
    import_table = list(range(1, 1 + used))
    num_bytes = args.layers * args.tokens * args.row * DTYPES[args.dtype].itemsize
    rows, importers = [], []
    for placement in placements:
        importer = holder_on(placement, use_gpu, args.two_nodes).remote(*shape, seed=2)
        importers.append(importer)
        tables = (export_table, import_table)
        found = [run_variant(exporter, importer, "per-layer", args, *tables, 0)]
        for chunk_mb in (int(c) for c in args.chunk_mb.split(",")):
            for variant in ("object-store", "shm"):
                found.append(
                    run_variant(exporter, importer, variant, args, *tables, chunk_mb << 20)
                )
        rows += [dict(row, importer=placement) for row in found]
    device = "cuda" if use_gpu else "cpu"
    print_rows(rows, num_bytes, args, device)
    if args.json:
        report = {"num_bytes": num_bytes, "device": device, "args": vars(args), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ray.get([actor.close.remote() for actor in (exporter, *importers)])  # unlinks the arena
    for actor in (exporter, *importers):
        ray.kill(actor)
    if started_ray or cluster is not None:
        ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return 0 if all(row["exact"] for row in rows) else 1


def start_two_nodes(args):
    """A local cluster of two nodes on this machine, each offering its NODE_RESOURCES name,
    and its temp dir; this process connects to it."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise SystemExit("--two-nodes starts its own local cluster: run it without Ray started")
    store_bytes = args.object_store_mb << 20
    cluster = Cluster()
    temp_dir = tempfile.mkdtemp(prefix="rayinfer-handoff-")  # not /tmp/ray: its own session
    for resource in NODE_RESOURCES.values():
        cluster.add_node(num_cpus=1, resources={resource: 4}, object_store_memory=store_bytes,
                         temp_dir=temp_dir, include_dashboard=False)  # fmt: skip
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    return cluster, temp_dir


def holder_on(placement: str, use_gpu: bool, two_nodes: bool):
    """The CacheHolder actor class, pinned to `placement`'s node in a --two-nodes run."""
    options = dict(num_cpus=0, num_gpus=0.5 if use_gpu else 0, max_concurrency=1)
    if two_nodes:
        options["resources"] = {NODE_RESOURCES[placement]: 1}
    return ray.remote(CacheHolder).options(**options)


def print_rows(rows: list[dict], num_bytes: int, args, device: str) -> None:
    print(f"hand-off of {num_bytes / 1e6:.1f} MB ({args.tokens} tokens x {args.layers} layers x "
          f"{args.row} {args.dtype}) between two actors on {device}")  # fmt: skip
    print(f"{'importer':10s} {'variant':12s} {'chunk':>6s} {'export ms':>10s} {'GB/s':>6s} "
          f"{'(copy/put)':>14s} {'import ms':>10s} {'GB/s':>6s} {'(get/copy)':>14s} "
          f"{'path':22s} exact")  # fmt: skip
    for row in rows:
        row["export_gb_s"] = num_bytes / row["export_s"] / 1e9
        row["import_gb_s"] = num_bytes / row["import_s"] / 1e9
        chunk = "-" if row["chunk_mb"] is None else f"{row['chunk_mb']}M"
        print(
            f"{row['importer']:10s} {row['variant']:12s} {chunk:>6s} "
            f"{row['export_s'] * 1e3:10.2f} {row['export_gb_s']:6.1f} "
            f"{row['export_copy_s'] * 1e3:6.2f}/{row['export_put_s'] * 1e3:<7.2f}"
            f" {row['import_s'] * 1e3:10.2f} {row['import_gb_s']:6.1f} "
            f"{row['import_get_s'] * 1e3:6.2f}/{row['import_copy_s'] * 1e3:<7.2f} "
            f"{row['path']:22s} {row['exact']}"
        )
    for placement in dict.fromkeys(row["importer"] for row in rows):
        here = {(r["variant"], r["chunk_mb"]): r for r in rows if r["importer"] == placement}
        base = here[("per-layer", None)]
        for (variant, chunk_mb), row in here.items():
            if variant == "shm":
                store = here[("object-store", chunk_mb)]
                print(f"{placement}: shm vs object-store, {chunk_mb}M chunks: export "
                      f"{store['export_s'] / row['export_s']:.1f}x, import "
                      f"{store['import_s'] / row['import_s']:.1f}x")  # fmt: skip
            if variant != "per-layer":
                print(f"{placement}: {variant} {chunk_mb}M vs per-layer: export "
                      f"{base['export_s'] / row['export_s']:.1f}x, import "
                      f"{base['import_s'] / row['import_s']:.1f}x")  # fmt: skip
    same = {(r["variant"], r["chunk_mb"]): r for r in rows if r["importer"] == "same node"}
    for row in rows:
        if row["importer"] == "other node":
            base = same[(row["variant"], row["chunk_mb"])]
            print(
                f"{row['variant']} {row['chunk_mb'] or ''}: other node vs same node: import "
                f"{row['import_gb_s']:.2f} vs {base['import_gb_s']:.2f} GB/s "
                f"({base['import_s'] / row['import_s']:.2f}x), get {row['import_get_s'] * 1e3:.1f}"
                f" vs {base['import_get_s'] * 1e3:.1f} ms"
            )
