"""`gpu_memory_utilization=0.9` on CUDA: the KV cache takes what the budget leaves, generation
works, and the device's peak reserved memory stays within the budget.

    python -m pytest -q -m gpu tests/gpu/test_memory_sizing.py
"""

import gc

import pytest
import torch

import rayinfer
from tests.gpu.families import greedy_tokens, vocab_size
from tests.models.harness import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

UTILIZATION = 0.9


def release_cached_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def test_kv_cache_fills_the_memory_budget(checkpoint_of):
    family = "deepseek_v3_h64"
    release_cached_memory()  # what earlier tests of this process left cached
    llm = rayinfer.LLM(
        str(checkpoint_of(family)),
        device="cuda",
        gpu_memory_utilization=UTILIZATION,
        max_model_len=4096,
    )
    num_blocks = len(llm.engine.block_managers[0].blocks)
    tokens = greedy_tokens(llm, make_prompts(vocab_size(family), lengths=(5, 300)))
    peak_fraction = (
        torch.cuda.max_memory_reserved() / torch.cuda.get_device_properties(0).total_memory
    )
    del llm
    release_cached_memory()
    # a tiny model's cache: far more than the default's 1,024 blocks (4 x max_model_len tokens)
    assert num_blocks > 100 * 1024, num_blocks
    assert [len(t) for t in tokens] == [16, 16]
    assert peak_fraction <= UTILIZATION, peak_fraction
