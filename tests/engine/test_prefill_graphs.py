"""Prefill CUDA graphs, the parts that run on the CPU: token buckets, which steps qualify, the
static inputs, and padding. On the CPU the padded static inputs run eagerly: a prompt padded to
its bucket must give the unpadded hidden states and cache entries, and write nothing for the
padding rows."""

import json

import pytest
import torch

import rayinfer
from rayinfer.config import ConfigError, ModelConfig, ParallelPlan
from rayinfer.engine.batch import ModelBatch, ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.graph_config import CudaGraphConfig, cuda_graph_config
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.workers.runner.decode_inputs import PAD_SLOT
from rayinfer.workers.runner.model_runner import ModelRunner
from rayinfer.workers.runner.prefill_graphs import (
    PrefillGraphs,
    StaticPrefillInputs,
    fits_static_prefill,
    prefill_graph_sizes,
    shared_prefill_bucket,
)
from tests.engine.test_decode_graphs import (
    BLOCK_SIZE,
    HF_CONFIGS,
    assert_only_slots_written,
    make_model,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompt_request(name: str, tokens: list[int], table: list[int], start: int = 0, **fields):
    return ScheduledRequest(name, tokens, start, table, True, GREEDY, **fields)


# --- buckets and which steps qualify ------------------------------------------------------------
def test_token_buckets_grow_by_at_most_half_up_to_the_cap():
    assert prefill_graph_sizes(8192) == [256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert prefill_graph_sizes(5000) == [256, 512, 1024, 1536, 2048, 3072, 4096, 5000]
    assert prefill_graph_sizes(100) == [100]
    assert prefill_graph_sizes(0) == []
    sizes = prefill_graph_sizes(1 << 16)
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))


def test_only_whole_new_prompts_qualify_and_the_group_shares_one_bucket():
    sizes = [256, 512, 1024]
    prompt = prompt_request("a", list(range(300)), [0])
    assert fits_static_prefill(prompt, 1024)
    assert not fits_static_prefill(prompt, 299)  # longer than the largest bucket
    assert not fits_static_prefill(prompt_request("b", [1, 2], [0], start=4), 1024)  # a chunk
    assert not fits_static_prefill(prompt_request("c", [1], [0]), 1024)  # one token: a decode
    wants_logprobs = prompt_request("d", [1, 2, 3], [0], prompt_logprob_targets=[2, 3, 4])
    assert not fits_static_prefill(wants_logprobs, 1024)
    short = prompt_request("e", [1, 2, 3], [0])
    assert shared_prefill_bucket([[prompt], [short]], sizes) == 512  # the longest's bucket
    assert shared_prefill_bucket([[short], []], sizes) == 256  # an idle replica pads
    assert shared_prefill_bucket([[], []], sizes) is None  # nothing to run
    assert shared_prefill_bucket([[prompt, short], []], sizes) is None  # two prompts: eager
    assert shared_prefill_bucket([[prompt]], []) is None  # no graphs


def test_static_inputs_hold_the_prompt_then_padding_that_writes_nothing():
    inputs = StaticPrefillInputs([8, 16], BLOCK_SIZE, kv_caches=[], device=torch.device("cpu"))
    step = inputs.fill([prompt_request("a", [11, 12, 13, 14, 15, 16], [3, 7])], bucket=8)
    assert step.input_ids.tolist() == [11, 12, 13, 14, 15, 16, 0, 0]
    assert step.positions.tolist() == list(range(8))
    attn = step.ctx.attn
    slots = [12, 13, 14, 15, 28, 29]  # blocks 3 and 7 of 4 slots
    assert attn.slot_mapping.tolist() == slots + [PAD_SLOT] * 2
    assert attn.block_tables.tolist() == [[3, 7]]
    assert attn.query_start_loc.tolist() == [0, 8] and attn.seq_lens.tolist() == [8]
    assert attn.query_lens_cpu == [8] and attn.seq_lens_cpu == [8]
    # A later step leaves no trace of the earlier prompt past its own rows and blocks.
    step = inputs.fill([prompt_request("b", [21, 22, 23, 24, 25], [5, 6])], bucket=16)
    assert step.input_ids.tolist() == [21, 22, 23, 24, 25] + [0] * 11
    assert step.ctx.attn.slot_mapping.tolist() == [20, 21, 22, 23, 24] + [PAD_SLOT] * 11
    assert step.ctx.attn.block_tables.tolist() == [[5, 6, 0, 0]]
    padding = inputs.fill_padding(8)
    assert padding.ctx.attn.slot_mapping.tolist() == [PAD_SLOT] * 8
    with pytest.raises(ValueError, match="2 prompts in a bucket of 8"):
        inputs.fill([prompt_request("a", [1, 2], [0])] * 2, bucket=8)
    with pytest.raises(ValueError, match="a prompt of 9 tokens in a bucket of 8"):
        inputs.fill([prompt_request("a", list(range(9)), [0, 1, 2])], bucket=8)


# --- padded runs on the CPU ---------------------------------------------------------------------
@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_a_padded_prompt_gives_the_unpadded_hidden_states_and_cache(family):
    """A 13-token prompt run in a bucket of 16 against the same prompt run eagerly. The padding
    makes every GEMM 16 rows high instead of 13, and CPU matmuls round differently for other
    heights, so the last bits may differ (not more: a real row never reads a padding row)."""
    model, caches = make_model(family)
    prompt, table = [5, 9, 2, 7, 1, 3, 4, 8, 6, 6, 1, 2, 9], [2, 5, 1, 4]
    before = [cache.clone() for cache in caches]
    graph_caches = [cache.clone() for cache in caches]
    graphs = PrefillGraphs(model, graph_caches, 16, BLOCK_SIZE, torch.device("cpu"))
    assert graphs.sizes == [16]
    request = prompt_request("a", prompt, table)
    assert graphs.bucket_of([request]) == 16
    with torch.inference_mode():
        padded = graphs.run([request], 16)  # [13, H]
        attn = build_attention_metadata([13], [13], [table], BLOCK_SIZE)
        eager = model(torch.tensor(prompt), torch.arange(13), ForwardContext(attn, caches))
    exact = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(padded, eager, **exact)
    written = [b * BLOCK_SIZE + o for b in table for o in range(BLOCK_SIZE)][:13]
    assert_only_slots_written(graph_caches, caches, before, written, exact)


def test_runner_sends_single_new_prompts_to_the_graphs_and_the_rest_eagerly(monkeypatch):
    config = ModelConfig.from_hf_dict(HF_CONFIGS["deepseek_v3"])
    graphs = CudaGraphConfig(max_batch_size=4, max_model_len=64, max_prefill_tokens=16)
    runner = ModelRunner(config, rayinfer.engine_config.CacheConfig(BLOCK_SIZE, 32), "cpu",
                         torch.float32, load_format="dummy", cuda_graphs=graphs)  # fmt: skip
    assert runner.prefill_graphs is not None and runner.prefill_graph_sizes == [16]
    calls = []
    run = runner.prefill_graphs.run
    monkeypatch.setattr(
        runner.prefill_graphs,
        "run",
        lambda reqs, bucket: calls.append((len(reqs), bucket)) or run(reqs, bucket),
    )
    assert len(runner.execute(ModelBatch([prompt_request("a", [1, 2, 3, 4, 5], [0, 1])]))) == 1
    assert calls == [(1, 16)]
    two = [prompt_request("b", [1, 2, 3], [2]), prompt_request("c", [4, 5], [3])]
    assert len(runner.execute(ModelBatch(two))) == 2  # two prompts: eager
    chunk = prompt_request("a", [6, 7], [0, 1], start=5)  # over a cached prefix: eager
    runner.execute(ModelBatch([chunk]))
    runner.execute(ModelBatch([prompt_request("d", list(range(1, 18)), [4, 5, 6, 7, 8])]))
    assert calls == [(1, 16)]  # 17 tokens: past the largest bucket
    runner.prefill_graphs.enabled = False
    runner.execute(ModelBatch([prompt_request("e", [1, 2, 3], [9])]))
    assert calls == [(1, 16)]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_moe"])
def test_llm_with_prefill_graphs_generates_the_eager_tokens(family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[family]))
    prompts = [[5, 9, 2, 7, 1, 3, 4], [3, 4, 8], list(range(1, 40))]  # the last one is chunked
    outputs = {}
    for cuda_graphs in (False, True):
        llm = rayinfer.LLM(str(tmp_path), device="cpu", load_format="dummy", max_num_seqs=1,
                           cuda_graphs=cuda_graphs, block_size=BLOCK_SIZE,
                           max_num_batched_tokens=32, max_graph_prefill_tokens=16)  # fmt: skip
        runner = llm.engine.executor.runner
        assert (runner.prefill_graph_sizes == [16]) == cuda_graphs
        outputs[cuda_graphs] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outputs[True] == outputs[False]


def test_prefill_graph_tokens_are_capped_and_checked():
    def resolve(max_prefill_tokens, max_model_len=1024):
        return cuda_graph_config(True, is_cuda=True, plan=ParallelPlan(), max_num_seqs=8,
                                 max_graph_batch_size=8, max_model_len=max_model_len,
                                 max_prefill_tokens=max_prefill_tokens)  # fmt: skip

    assert resolve(4096).max_prefill_tokens == 1024  # no prompt is longer than max_model_len
    assert resolve(0).max_prefill_tokens == 0
    with pytest.raises(ConfigError, match="max_graph_prefill_tokens=-1 must be >= 0"):
        resolve(-1)
    llm_config = rayinfer.LLM("tiny", device="cpu", cuda_graphs=True, max_num_batched_tokens=512)
    assert llm_config.spec.cuda_graphs.max_prefill_tokens == 512  # capped by the step's budget


# --- the two-batch overlap inside a captured prefill --------------------------------------------
def test_the_static_halves_are_the_split_of_the_padded_prompt():
    from rayinfer.layers.forward_context import split_forward_context
    from rayinfer.overlap_config import OverlapConfig

    overlap = OverlapConfig(first_share=0.375)  # any cut: the static halves follow it
    inputs = StaticPrefillInputs([16], BLOCK_SIZE, [], torch.device("cpu"), overlap)
    step = inputs.fill([prompt_request("a", list(range(1, 12)), [3, 7, 2])], bucket=16)
    cut = overlap.first_micro_batch_tokens(16)
    assert cut == 6
    for static, split in zip(step.ctx.micro_batches, split_forward_context(step.ctx, cut)):
        static, split = static.attn, split.attn
        for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            assert getattr(static, field).tolist() == getattr(split, field).tolist(), field
        assert static.query_lens_cpu == split.query_lens_cpu
        assert static.seq_lens_cpu == split.seq_lens_cpu


def test_an_overlapped_padded_prompt_gives_the_plain_hidden_states():
    """The tiny DeepSeek-V3 (MLA: the second half reads the first half's latents back from the
    cache) through both lanes over the static halves, against one plain forward."""
    from rayinfer.layers.two_batch_overlap import forward_two_batch_overlap

    model, caches = make_model("deepseek_v3")
    inputs = StaticPrefillInputs([16], BLOCK_SIZE, caches, torch.device("cpu"))
    step = inputs.fill(
        [prompt_request("a", [5, 9, 2, 7, 1, 3, 4, 8, 6, 6, 1, 2, 9], [2, 5, 1, 4])], 16
    )
    with torch.inference_mode():
        overlapped = forward_two_batch_overlap(model, *step)  # [16, H]
        plain = model(*step)
    torch.testing.assert_close(overlapped[:13], plain[:13], rtol=0, atol=1e-5)


def test_when_a_captured_prefill_overlaps_is_a_setting():
    from rayinfer.overlap_config import DEFAULT_GRAPH_OVERLAP_FROM, OverlapConfig

    default = OverlapConfig()
    assert default.overlaps_in_graph(DEFAULT_GRAPH_OVERLAP_FROM)
    assert not default.overlaps_in_graph(DEFAULT_GRAPH_OVERLAP_FROM - 1)
    earlier = OverlapConfig(graph_overlap_from=1024)
    assert earlier.overlaps_in_graph(1024) and not earlier.overlaps_in_graph(1023)
    assert not OverlapConfig(graph_overlap_from=None).overlaps_in_graph(1 << 20)
    with pytest.raises(ConfigError, match=r"overlap\.graph_overlap_from='soon'; use a number"):
        OverlapConfig(graph_overlap_from="soon")
