"""A WorkerGroup sizing its KV cache from GPU memory (`gpu_memory_utilization`): every worker
profiles, the group allocates the smallest count on all of them and reports it to the engine.

The Workers run in this process behind stand-in handles (a faked torch.cuda cannot reach Ray
actors); one real group on the CPU checks that the setting passes through Serve's runtime."""

from __future__ import annotations

import uuid

import pytest
import torch

from rayinfer.config import ModelConfig
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.runtime import ModelSource, build_engine
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine_config import CacheConfig, KVMemoryConfig
from rayinfer.workers.group import WorkerGroup
from rayinfer.workers.runner import model_runner
from rayinfer.workers.runner.kv_memory import kv_bytes_per_block
from rayinfer.workers.spec import WorkerSpec
from rayinfer.workers.worker import Worker
from tests.engine.test_kv_memory import GIB, MIB, FakeCuda

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class Handle:
    """`worker.method.remote(...)` for a Worker living in this process; `in_use` is the device
    memory its GPU shows in use while it runs."""

    def __init__(self, worker: Worker, cuda: FakeCuda, in_use: int):
        self.worker, self.cuda, self.in_use = worker, cuda, in_use
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        import ray

        handle = self

        class Method:
            @staticmethod
            def remote(*args):
                handle.calls.append((name, *args))
                if handle.cuda is not None:
                    handle.cuda.in_use = handle.in_use
                return ray.put(getattr(handle.worker, name)(*args))

        return Method


@pytest.fixture
def fake_gpus(monkeypatch):
    monkeypatch.setattr(model_runner, "supports_memory_sizing", lambda device: True)
    monkeypatch.setattr(model_runner, "SAFETY_MARGIN_BYTES", 0)
    return FakeCuda(monkeypatch, total=GIB, allocated=0)


def spec(kv_memory: KVMemoryConfig | None) -> WorkerSpec:
    return WorkerSpec(
        ModelConfig.from_pretrained(ModelSource.resolve(AppConfig()).path),
        CacheConfig(16, 64),
        device="cpu",
        dtype=torch.float32,
        kv_memory=kv_memory,
    )


def group_of(handles: list[Handle]) -> WorkerGroup:
    group = WorkerGroup.__new__(WorkerGroup)  # the workers exist already
    group.workers = handles
    return group


def test_group_allocates_the_smallest_count_on_every_worker(ray_cluster, fake_gpus):
    worker_spec = spec(KVMemoryConfig(0.5, 64, 128))
    workers = [Worker(f"w-r{rank}", rank, 1, worker_spec) for rank in range(3)]
    assert all(w.runner.kv_caches == [] for w in workers)  # waiting for the group's count
    handles = [
        Handle(w, fake_gpus, in_use) for w, in_use in zip(workers, (100 * MIB, 300 * MIB, 0))
    ]
    num_blocks = group_of(handles)._agree_on_kv_blocks(configured=64)
    per_block = kv_bytes_per_block(worker_spec.model_config, 1, 4, 16)
    assert num_blocks == (GIB // 2 - 300 * MIB) // per_block  # the fullest GPU decides
    for worker in workers:
        assert worker.runner.cache_config.num_blocks == num_blocks
        assert worker.runner.kv_caches[0].shape[0] == num_blocks
    assert all(h.calls[-1] == ("allocate_kv", num_blocks) for h in handles)


def test_workers_off_cuda_keep_the_configured_cache(ray_cluster):
    worker_spec = spec(KVMemoryConfig(0.5, 64, 128))
    workers = [Worker(f"w-r{rank}", rank, 1, worker_spec) for rank in range(2)]
    assert all(w.runner.kv_caches[0].shape[0] == 64 for w in workers)  # allocated at once
    handles = [Handle(w, None, 0) for w in workers]
    assert group_of(handles)._agree_on_kv_blocks(configured=64) is None
    assert all(h.calls == [("kv_blocks_that_fit",)] for h in handles)  # nothing reallocated


def test_serve_phase_setting_becomes_the_workers_kv_memory(monkeypatch):
    specs = []

    class FakeGroup:
        num_kv_blocks = 300  # what the workers agreed on
        num_kv_partitions = 1

        def __init__(self, name_prefix, spec, **kwargs):
            specs.append(spec)

    monkeypatch.setattr("rayinfer.workers.group.WorkerGroup", FakeGroup)  # build_engine imports it
    monkeypatch.setattr("rayinfer.deployments.runtime.uses_gpus", lambda config: True)
    config = AppConfig(
        max_model_len=128,
        prefill={"gpu_memory_utilization": 0.8, "num_kv_blocks": 40},
        decode={"gpu_memory_utilization": 0.7, "max_num_seqs": 8, "gpus_per_worker": 0.5},
    )
    source = ModelSource.resolve(config)
    decode_engine, _ = build_engine(config, source, "decode", "d")
    assert specs[0].kv_memory == KVMemoryConfig(
        0.7, 2048, 128, 8, key="decode.gpu_memory_utilization", gpu_share=0.5
    )  # 0.7 of the worker's half of its GPU
    assert decode_engine.cache_config.num_blocks == 300  # the engine takes the group's count
    build_engine(config, source, "prefill", "p")
    assert specs[1].kv_memory is None  # num_kv_blocks given: it wins
    build_engine(AppConfig(max_model_len=128), source, "engine", "e")
    assert specs[2].kv_memory == KVMemoryConfig(
        0.9, 8192, 128, 128, key="engine.gpu_memory_utilization"
    )  # on GPUs, by default: 0.9 of a whole GPU


def test_the_cpu_keeps_the_token_count_rule(monkeypatch):
    from rayinfer.deployments.runtime import kv_capacity, kv_memory_config

    config = AppConfig.from_args({"max_model_len": "128", "decode.gpu_memory_utilization": "0.9"})
    assert kv_memory_config(config.decode, "decode", use_gpus=False, max_model_len=128) is None

    class Engine:
        cache_config = CacheConfig(16, 16384 // 16)
        model_config = ModelConfig.from_pretrained(ModelSource.resolve(config).path)
        executor = type("Group", (), {"num_kv_partitions": 2})

    capacity = kv_capacity(config, ModelSource.resolve(config), "decode", Engine)
    assert capacity.num_tokens == 2 * 16384
    assert capacity.bytes_per_token == kv_bytes_per_block(Engine.model_config, 1, 4, 1)
    line = capacity.describe("decode")
    assert "1024 blocks x 2 partitions of 16 tokens = 32768 tokens" in line
    assert "max(4 x max_model_len, 16384) tokens" in line


def test_serve_phase_setting_reaches_the_workers(ray_cluster):
    """On the CPU the workers keep the token-count default; the engine runs as before."""
    config = AppConfig(max_model_len=128, decode={"gpu_memory_utilization": 0.9})
    source = ModelSource.resolve(config)
    engine, group = build_engine(config, source, "decode", f"kv-sizing-{uuid.uuid4().hex[:6]}")
    try:
        assert group.num_kv_blocks is None
        assert engine.cache_config.num_blocks == 16384 // 16
        engine.add_request("a", [5, 17, 42, 99], GREEDY)
        finished = []
        for _ in range(50):
            finished += [o for o in engine.step() if o.finished]
            if finished:
                break
        assert len(finished[0].token_ids) == 4
    finally:
        group.shutdown()
