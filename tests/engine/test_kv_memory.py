"""Sizing the KV cache from GPU memory (`gpu_memory_utilization`): the pure arithmetic, the CUDA
probes against a faked torch.cuda, and the runner / LLM / engine plumbing, all on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

import rayinfer
from rayinfer.config import ConfigError, ModelConfig
from rayinfer.engine.engine import LLMEngine
from rayinfer.engine_config import (
    CacheConfig,
    KVMemoryConfig,
    SchedulerConfig,
    check_gpu_memory_utilization,
)
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.graph_config import CudaGraphConfig
from rayinfer.layers.parallel import LayerGroup, ParallelContext
from rayinfer.workers.in_process import InProcessExecutor
from rayinfer.workers.runner import kv_memory, model_runner
from rayinfer.workers.runner.kv_memory import (
    CUDA_CONTEXT_ESTIMATE_BYTES,
    CUDA_GRAPH_RESERVE_BYTES,
    GIB,
    SAFETY_MARGIN_BYTES,
    activation_peak_bytes,
    device_memory,
    kv_bytes_per_block,
    non_kv_bytes,
    num_kv_blocks_for_memory,
    own_process_bytes,
    process_bytes_from_smi,
    worker_memory,
)
from rayinfer.workers.runner.model_runner import ModelRunner
from rayinfer.workers.spec import WorkerSpec
from tests.models.harness import TINY_DENSE, TINY_MLA, make_hf_checkpoint, make_prompts

MIB = 2**20
GREEDY = rayinfer.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def blocks(**overrides) -> int:
    args = dict(
        total_bytes=80 * GIB,
        utilization=0.9,
        non_kv_bytes=20 * GIB,
        activation_peak_bytes=2 * GIB,
        bytes_per_block=MIB,
        block_size=16,
        max_model_len=4096,
        reserve_bytes=GIB,
    )
    return num_kv_blocks_for_memory(**{**args, **overrides})


# --- the arithmetic ---------------------------------------------------------------------------
def test_blocks_fill_the_budget_left_after_weights_activations_and_reserve():
    # 80 GiB x 0.9 = 72 GiB, minus 20 in use, 2 of activations and 1 of reserve: 49 GiB of 1 MiB
    assert blocks() == 49 * 1024
    assert blocks(utilization=1.0) == 57 * 1024
    assert blocks(reserve_bytes=0) == 50 * 1024


def test_partial_blocks_are_dropped():
    assert blocks(bytes_per_block=3 * MIB) == (49 * 1024) // 3
    assert blocks(activation_peak_bytes=2 * GIB + 1) == 49 * 1024 - 1


def test_the_budget_is_a_fraction_of_the_total_not_of_the_free_memory():
    # Memory in use (another process, the weights) is subtracted from total x utilization.
    assert blocks(non_kv_bytes=60 * GIB) == 9 * 1024
    assert blocks(total_bytes=141 * GIB, utilization=0.5, non_kv_bytes=0) == math.floor(
        (141 * GIB * 0.5 - 3 * GIB) / MIB
    )


def test_exactly_one_max_model_len_sequence_is_enough():
    needed = 4096 // 16  # blocks of one 4096-token sequence
    room = 72 * GIB - 20 * GIB - 2 * GIB - GIB
    exact = dict(reserve_bytes=GIB + room - needed * MIB)
    assert blocks(**exact) == needed
    with pytest.raises(ConfigError):
        blocks(reserve_bytes=exact["reserve_bytes"] + 1)


def test_too_little_memory_names_the_setting_the_length_and_the_bytes():
    with pytest.raises(ConfigError) as error:
        blocks(non_kv_bytes=75 * GIB, max_model_len=100_000, key="decode.gpu_memory_utilization")
    message = str(error.value)
    assert "decode.gpu_memory_utilization=0.9" in message
    assert "max_model_len=100000" in message
    assert f"needs {-(-100_000 // 16)} blocks" in message and "1048576 bytes per block" in message
    assert "raise decode.gpu_memory_utilization" in message


def test_partial_last_block_of_max_model_len_counts_as_a_block():
    room_for = 4096 // 16 + 1
    reserve = 72 * GIB - 22 * GIB - room_for * MIB
    assert blocks(reserve_bytes=reserve, max_model_len=4097) == room_for
    with pytest.raises(ConfigError, match="needs 258 blocks"):
        blocks(reserve_bytes=reserve, max_model_len=4096 + 17)


def test_a_gpu_share_gets_its_fraction_of_the_budget():
    """Two workers of 0.5 on one 80 GiB GPU: 36 GiB each, minus each one's own 20 GiB."""
    assert blocks(gpu_share=0.5) == (36 - 20 - 2 - 1) * 1024
    assert blocks(gpu_share=1.0) == blocks()
    with pytest.raises(ConfigError, match=r"0\.5 GPU share x 0\.9 = 36\.00 GiB") as error:
        blocks(gpu_share=0.5, non_kv_bytes=34 * GIB, key="decode.gpu_memory_utilization")
    assert "this worker's weights and CUDA context" in str(error.value)
    with pytest.raises(ValueError, match="gpu_share"):
        blocks(gpu_share=0)


def test_sharers_subtract_their_own_usage_and_whole_gpus_everything_in_use():
    """Starting together, sharers must not each count the other's usage as theirs to take:
    each subtracts what its own process holds; a whole-GPU worker everything on the device."""
    assert non_kv_bytes(gpu_share=1.0, device_in_use_bytes=30 * GIB, own_bytes=18 * GIB) == (
        30 * GIB
    )
    assert non_kv_bytes(gpu_share=0.5, device_in_use_bytes=30 * GIB, own_bytes=18 * GIB) == (
        18 * GIB
    )


def test_own_usage_is_nvmls_figure_or_the_allocator_plus_a_context_estimate():
    assert own_process_bytes(nvml_bytes=19 * GIB, allocator_reserved_bytes=18 * GIB) == 19 * GIB
    # NVML never reports less than the allocator holds (a stale sample)
    assert own_process_bytes(nvml_bytes=GIB, allocator_reserved_bytes=18 * GIB) == 18 * GIB
    fallback = own_process_bytes(nvml_bytes=None, allocator_reserved_bytes=18 * GIB)
    assert fallback == 18 * GIB + CUDA_CONTEXT_ESTIMATE_BYTES


SMI = """4242, GPU-1a2b3c4d-0000-1111-2222-333344445555, 20480
4243, GPU-1a2b3c4d-0000-1111-2222-333344445555, 18000
4242, GPU-99999999-0000-1111-2222-333344445555, 500
[N/A], GPU-99999999-0000-1111-2222-333344445555, [N/A]
"""


def test_nvidia_smi_rows_are_matched_on_pid_and_gpu():
    uuid = "1a2b3c4d-0000-1111-2222-333344445555"  # torch's form: no GPU- prefix
    assert process_bytes_from_smi(SMI, 4242, uuid) == 20480 * MIB
    assert process_bytes_from_smi(SMI, 4242) == (20480 + 500) * MIB  # any GPU
    assert process_bytes_from_smi(SMI, 4243, "GPU-" + uuid.upper()) == 18000 * MIB
    assert process_bytes_from_smi(SMI, 7, uuid) is None  # not listed (another pid namespace)
    assert process_bytes_from_smi("", 4242) is None


def test_worker_memory_of_a_share_probes_this_process(monkeypatch):
    FakeCuda(monkeypatch, total=80 * GIB, in_use=50 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 18 * GIB)

    class Properties:
        uuid = "1a2b3c4d-0000-1111-2222-333344445555"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties)
    seen = []
    monkeypatch.setattr(
        kv_memory, "process_gpu_bytes", lambda pid, uuid: seen.append(uuid) or 19 * GIB
    )
    cpu = torch.device("cpu")
    assert worker_memory(cpu, 1.0) == (80 * GIB, 50 * GIB)  # whole GPU: everything in use
    assert seen == []
    assert worker_memory(cpu, 0.5) == (80 * GIB, 19 * GIB)
    assert seen == [Properties.uuid]
    monkeypatch.setattr(kv_memory, "process_gpu_bytes", lambda pid, uuid: None)
    assert worker_memory(cpu, 0.5) == (80 * GIB, 18 * GIB + CUDA_CONTEXT_ESTIMATE_BYTES)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01])
def test_utilization_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=.* \(0, 1\]"):
        blocks(utilization=utilization)


@pytest.mark.parametrize(
    "bad", [dict(bytes_per_block=0), dict(block_size=0), dict(activation_peak_bytes=-1)]
)
def test_nonsense_sizes_are_programming_errors(bad):
    with pytest.raises(ValueError):
        blocks(**bad)


@pytest.mark.parametrize("value", [0, 0.0, -1, 1.5, True, "0.9", float("nan")])
def test_check_gpu_memory_utilization_names_the_key_and_the_range(value):
    with pytest.raises(ConfigError) as error:
        check_gpu_memory_utilization(value, "prefill.gpu_memory_utilization")
    assert "prefill.gpu_memory_utilization=" in str(error.value)
    assert "(0, 1]" in str(error.value)


def test_check_gpu_memory_utilization_accepts_fractions_and_none():
    assert check_gpu_memory_utilization(None) is None
    assert check_gpu_memory_utilization(0.9) == 0.9
    assert check_gpu_memory_utilization(1) == 1.0


def test_kv_memory_config_validates_with_its_key():
    with pytest.raises(ConfigError, match=r"decode\.gpu_memory_utilization=2"):
        KVMemoryConfig(2, 2048, 4096, key="decode.gpu_memory_utilization")
    with pytest.raises(ConfigError, match="max_model_len=0"):
        KVMemoryConfig(0.5, 2048, 0)
    with pytest.raises(ConfigError, match="gpu_share=1.5"):
        KVMemoryConfig(0.5, 2048, 4096, gpu_share=1.5)


# --- bytes per block --------------------------------------------------------------------------
def model_config(**hf) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf)


LLAMA = dict(TINY_DENSE, architectures=["LlamaForCausalLM"])
DEEPSEEK = dict(TINY_MLA, architectures=["DeepseekV3ForCausalLM"])


def test_bytes_per_block_splits_gqa_heads_over_tp_and_replicates_mla():
    llama = model_config(**LLAMA)  # 2 layers, 2 K/V heads of 16
    assert kv_bytes_per_block(llama, 1, 2, 16) == 2 * (2 * 2 * 16) * 2 * 16
    assert kv_bytes_per_block(llama, 2, 2, 16) == kv_bytes_per_block(llama, 1, 2, 16) // 2
    assert kv_bytes_per_block(llama, 1, 2, 1) == llama.kv_bytes_per_token(2)
    deepseek = model_config(**DEEPSEEK)  # latent 16 + rope 8, same on every rank
    assert kv_bytes_per_block(deepseek, 1, 2, 16) == 2 * 24 * 2 * 16
    assert kv_bytes_per_block(deepseek, 4, 2, 16) == kv_bytes_per_block(deepseek, 1, 2, 16)


@pytest.mark.parametrize("hf, tp_rank", [(LLAMA, 0), (LLAMA, 1), (DEEPSEEK, 1)])
def test_bytes_per_block_is_what_the_runner_allocates(hf, tp_rank):
    config = model_config(**hf)
    runner = ModelRunner.__new__(ModelRunner)  # only the cache: no weights needed
    runner.model_config = config
    runner.cache_config = CacheConfig(block_size=8, num_blocks=5)
    runner.device, runner.dtype = torch.device("cpu"), torch.bfloat16
    runner.kv_shapes = config.kv_shapes_on_rank(2, 2)
    allocated = sum(c.numel() * c.element_size() for c in runner._new_kv_caches(5))
    assert allocated == 5 * kv_bytes_per_block(config, 2, 2, 8)


# --- the CUDA probes, against a fake allocator ------------------------------------------------
class FakeCuda:
    """torch.cuda's memory statistics for a device with `total` bytes and `in_use` taken."""

    def __init__(self, monkeypatch, total=80 * GIB, in_use=20 * GIB, allocated=18 * GIB):
        self.total, self.in_use = total, in_use
        self.allocated = self.peak = allocated
        self.calls: list[str] = []
        for name in ("synchronize", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, self._record(name))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda device=None: (self.total - self.in_use, self.total)
        )

    def _record(self, name):
        return lambda device=None: self.calls.append(name)

    def _reset(self, device=None):
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def spike(self, num_bytes: int) -> None:
        """What a forward's temporaries do to the peak."""
        self.peak = max(self.peak, self.allocated + num_bytes)


def test_activation_peak_is_the_forward_peak_above_what_was_allocated(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    cuda.peak = 30 * GIB  # an earlier peak (weight loading) must not count
    peak = activation_peak_bytes(lambda: cuda.spike(3 * GIB), torch.device("cpu"))
    assert peak == 3 * GIB
    assert cuda.calls[:2] == ["synchronize", "reset_peak_memory_stats"]
    assert cuda.calls[-1] == "synchronize"  # the forward's kernels finished before reading


def test_device_memory_frees_the_cache_first_and_counts_everything_in_use(monkeypatch):
    cuda = FakeCuda(monkeypatch, total=141 * GIB, in_use=40 * GIB)
    assert device_memory(torch.device("cpu")) == (141 * GIB, 40 * GIB)
    assert "empty_cache" in cuda.calls


# --- the runner: profile, size, allocate ------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **TINY_DENSE)


def make_runner(checkpoint, **kwargs) -> ModelRunner:
    config = ModelConfig.from_pretrained(checkpoint)
    return ModelRunner(config, CacheConfig(16, 64), "cpu", torch.float32, **kwargs)


def test_profiling_step_is_the_largest_step_over_the_longest_context(checkpoint, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    runner = make_runner(checkpoint)
    seen = {}
    forward = runner.forward

    def spy(input_ids, positions, ctx):
        seen.update(
            tokens=input_ids.shape[0],
            positions=(int(positions[0]), int(positions[-1])),
            seq_lens=ctx.attn.seq_lens_cpu,
            cache_blocks=ctx.kv_caches[0].shape[0],
        )
        cuda.spike(5 * MIB)
        return forward(input_ids, positions, ctx)

    monkeypatch.setattr(runner, "forward", spy)
    config = KVMemoryConfig(0.5, max_num_batched_tokens=48, max_model_len=200, max_num_seqs=4)
    num_blocks = runner.kv_blocks_that_fit(config)
    assert seen == dict(tokens=48, positions=(152, 199), seq_lens=[200], cache_blocks=13)
    per_block = kv_bytes_per_block(runner.model_config, 1, 4, 16)
    assert num_blocks == (40 * GIB - 20 * GIB - 5 * MIB - SAFETY_MARGIN_BYTES) // per_block
    # A step never exceeds max_model_len tokens.
    runner.kv_blocks_that_fit(KVMemoryConfig(0.5, 4096, 100))
    assert seen["tokens"] == 100 and seen["seq_lens"] == [100]


def test_decode_graphs_reserve_their_pool(checkpoint, monkeypatch):
    FakeCuda(monkeypatch)
    graphs = CudaGraphConfig(max_batch_size=8, max_model_len=256)
    config = KVMemoryConfig(0.5, 64, 256)
    with_graphs = make_runner(checkpoint, cuda_graphs=graphs).kv_blocks_that_fit(config)
    without = make_runner(checkpoint).kv_blocks_that_fit(config)
    per_block = kv_bytes_per_block(ModelConfig.from_pretrained(checkpoint), 1, 4, 16)
    assert without - with_graphs == pytest.approx(CUDA_GRAPH_RESERVE_BYTES / per_block, abs=1)


def test_ranks_whose_exchange_cannot_be_replayed_take_no_graph_reserve(checkpoint, monkeypatch):
    FakeCuda(monkeypatch)
    runner = make_runner(checkpoint, cuda_graphs=CudaGraphConfig(8, 256))
    runner.parallel = ParallelContext(tp_rank=0, tp_size=2)  # all-reduces are captured
    assert runner.captures_decode_graphs
    host = LayerGroup(None, rank=0, size=2, all_to_all=AllToAllConfig(transport="host"))
    runner.parallel = ParallelContext(
        ep_rank=0, ep_size=2, ep_group=host, tokens_differ_across_ep=True
    )  # host-staged token exchange: replayed (two-state flags)
    assert runner.captures_decode_graphs
    dedup = LayerGroup(None, rank=0, size=2, all_to_all=AllToAllConfig(dedup=True))
    runner.parallel = ParallelContext(
        ep_rank=0, ep_size=2, ep_group=dedup, tokens_differ_across_ep=True
    )  # sized from the routing on the host: eager
    assert not runner.captures_decode_graphs


def test_a_runner_with_a_gpu_share_sizes_from_its_share(checkpoint, monkeypatch):
    FakeCuda(monkeypatch, total=80 * GIB, in_use=50 * GIB)
    monkeypatch.setattr(model_runner, "worker_memory", lambda device, share: (80 * GIB, 4 * GIB))
    runner = make_runner(checkpoint)
    per_block = kv_bytes_per_block(runner.model_config, 1, 4, 16)
    num_blocks = runner.kv_blocks_that_fit(KVMemoryConfig(0.5, 64, 256, gpu_share=0.25))
    assert num_blocks == (10 * GIB - 4 * GIB - SAFETY_MARGIN_BYTES) // per_block


def test_a_device_too_small_for_one_sequence_fails_naming_the_setting(checkpoint, monkeypatch):
    FakeCuda(monkeypatch, total=GIB, in_use=GIB // 2)
    runner = make_runner(checkpoint)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0\.9 .* max_model_len=256"):
        runner.kv_blocks_that_fit(KVMemoryConfig(0.9, 64, 256))


def test_off_cuda_the_configured_count_stands(checkpoint):
    runner = make_runner(checkpoint, kv_memory=KVMemoryConfig(0.9, 64, 256))
    assert runner.kv_memory is None and runner.kv_blocks_that_fit() is None
    assert runner.kv_caches[0].shape[0] == 64


def test_allocate_kv_later_sets_the_count(checkpoint):
    runner = make_runner(checkpoint, allocate_kv=False)
    assert runner.kv_caches == []
    runner.allocate_kv(10)
    assert runner.cache_config.num_blocks == 10 and runner.kv_caches[0].shape[0] == 10


# --- end to end: LLM and the engine take the executor's count ---------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """Treat the CPU as a CUDA device of 1 GiB with 256 MiB in use."""
    monkeypatch.setattr(model_runner, "supports_memory_sizing", lambda device: True)
    monkeypatch.setattr(model_runner, "SAFETY_MARGIN_BYTES", 0)
    return FakeCuda(monkeypatch, total=GIB, in_use=256 * MIB, allocated=0)


def test_llm_sizes_its_cache_from_memory_and_generates(checkpoint, fake_gpu):
    prompts = make_prompts(TINY_DENSE["vocab_size"], lengths=(5, 9))
    reference = rayinfer.LLM(str(checkpoint), device="cpu", max_model_len=128).generate(
        prompts, GREEDY
    )
    llm = rayinfer.LLM(
        str(checkpoint), device="cpu", max_model_len=128, gpu_memory_utilization=0.26
    )
    per_block = kv_bytes_per_block(llm.model_config, 1, 4, 16)
    expected = (math.floor(GIB * 0.26) - 256 * MIB) // per_block
    assert llm.cache_config.num_blocks == expected
    assert len(llm.engine.block_manager.blocks) == expected
    assert llm.engine.executor.runner.kv_caches[0].shape[0] == expected
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]


def test_given_num_kv_blocks_wins_over_gpu_memory_utilization(checkpoint, fake_gpu):
    llm = rayinfer.LLM(
        str(checkpoint),
        device="cpu",
        max_model_len=128,
        num_kv_blocks=40,
        gpu_memory_utilization=0.5,
    )
    assert llm.spec.kv_memory is None and llm.cache_config.num_blocks == 40
    assert "reset_peak_memory_stats" not in fake_gpu.calls  # no profiling step


def test_llm_refuses_a_bad_utilization_naming_the_key(checkpoint):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1\.5 .*\(0, 1\]"):
        rayinfer.LLM(str(checkpoint), device="cpu", gpu_memory_utilization=1.5)


def test_llm_off_cuda_keeps_the_token_count_default(checkpoint):
    llm = rayinfer.LLM(str(checkpoint), device="cpu", max_model_len=128, gpu_memory_utilization=0.9)
    assert llm.cache_config.num_blocks == 16384 // 16


def test_engine_takes_the_executors_block_count(checkpoint):
    config = ModelConfig.from_pretrained(checkpoint)
    executor = InProcessExecutor(WorkerSpec(config, CacheConfig(16, 64), "cpu", torch.float32))
    executor.runner.allocate_kv(20)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(4, 64, 128), executor)
    assert engine.cache_config.num_blocks == 20 and len(engine.block_manager.blocks) == 20
