"""`gpu_memory_utilization=0.9` on CUDA: the KV cache takes what the budget leaves, generation
works, and the device's peak reserved memory stays within the budget. The model has
DeepSeek-V2-Lite's shapes with random weights (benchmarks/configs/deepseek-v2-lite,
load_format="dummy"), so that the cache is a real model's count of blocks (a tiny model's would
be ~86 million on an H200, each one an object of the block manager).

    python -m pytest -q -m gpu tests/gpu/test_memory_sizing.py
"""

import gc
from pathlib import Path

import pytest
import torch

import rayinfer
from rayinfer.config import ModelConfig
from tests.gpu.families import greedy_tokens
from tests.models.harness import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

V2_LITE = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "deepseek-v2-lite"
UTILIZATION = 0.9


def release_cached_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def test_kv_cache_fills_the_memory_budget():
    release_cached_memory()  # what earlier tests of this process left cached
    llm = rayinfer.LLM(
        str(V2_LITE),
        device="cuda",
        load_format="dummy",
        gpu_memory_utilization=UTILIZATION,
        max_model_len=4096,
    )
    num_blocks = len(llm.engine.block_managers[0].blocks)
    prompts = make_prompts(ModelConfig.from_pretrained(V2_LITE).vocab_size, lengths=(5, 300))
    tokens = greedy_tokens(llm, prompts)
    total = torch.cuda.get_device_properties(0).total_memory
    peak_fraction = torch.cuda.max_memory_reserved() / total
    del llm
    release_cached_memory()
    # far more than the default's 1,024 blocks (4 x max_model_len tokens)
    assert num_blocks > 10 * 1024, num_blocks
    assert [len(t) for t in tokens] == [16, 16]
    assert peak_fraction <= UTILIZATION, peak_fraction
