"""Piecewise CUDA graphs (mixed steps cut at each attention), the parts that run on the CPU:
token buckets, the static inputs and their padding, the staging of attention operands, which
steps the runner sends there, and whole generations against the eager engine. On the CPU the
pieces run eagerly over the same padded inputs and staging buffers (the GPU's capture and replay
are in tests/gpu/test_cuda_graphs.py)."""

import json

import pytest
import torch

import rayinfer
from rayinfer.config import ConfigError, ModelConfig, ParallelPlan
from rayinfer.engine.batch import ModelBatch, ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.graph_config import CudaGraphConfig, cuda_graph_config
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.layers.graph_pieces import StagingBuffers, cuts_every_attention
from rayinfer.workers.runner.decode_inputs import PAD_SLOT
from rayinfer.workers.runner.model_runner import ModelRunner
from rayinfer.workers.runner.piecewise_graphs import (
    PiecewiseGraphs,
    StaticStepInputs,
    piecewise_graph_sizes,
)
from tests.engine.test_decode_graphs import (
    BLOCK_SIZE,
    HF_CONFIGS,
    assert_only_slots_written,
    make_model,
    prefill,
)
from tests.models.test_dsa import TINY_DSA

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def request(name: str, tokens: list[int], table: list[int], start: int = 0, **fields):
    return ScheduledRequest(name, tokens, start, table, True, GREEDY, **fields)


def test_token_buckets_double_then_grow_by_at_most_half_up_to_the_cap():
    assert piecewise_graph_sizes(4096) == [
        32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
    ]  # fmt: skip
    assert piecewise_graph_sizes(100) == [32, 64, 100]
    assert piecewise_graph_sizes(20) == [20]
    assert piecewise_graph_sizes(0) == []
    with pytest.raises(ValueError, match="max_tokens=-1"):
        piecewise_graph_sizes(-1)


def test_static_inputs_hold_the_step_then_padding_and_the_steps_own_metadata():
    inputs = StaticStepInputs(16, BLOCK_SIZE, kv_caches=[], device=torch.device("cpu"))
    decode = request("d", [40], [3, 7], start=5)  # position 5: block 7, offset 1
    chunk = request("c", [11, 12, 13], [2, 6], start=2)  # positions 2..4 over a cached prefix
    (input_ids, positions, ctx), step = inputs.fill([decode, chunk], bucket=8)
    assert input_ids.tolist() == [40, 11, 12, 13, 0, 0, 0, 0]
    assert positions.tolist() == [5, 2, 3, 4, 0, 0, 0, 0]
    slots = [29, 10, 11, 24]
    assert ctx.attn.slot_mapping.tolist() == slots + [PAD_SLOT] * 4
    assert ctx.attn.query_lens_cpu == [8]  # the pieces see the bucket, the attention the step
    attn = step.attn
    assert attn.query_lens_cpu == [1, 3] and attn.seq_lens_cpu == [6, 5]
    assert attn.query_start_loc.tolist() == [0, 1, 4]
    assert attn.block_tables.tolist() == [[3, 7], [2, 6]]
    assert attn.slot_mapping.tolist() == slots
    # A later, smaller step leaves nothing of this one in its bucket.
    (input_ids, _, ctx), _ = inputs.fill([request("e", [21, 22], [5])], bucket=4)
    assert input_ids.tolist() == [21, 22, 0, 0]
    assert ctx.attn.slot_mapping.tolist() == [20, 21, PAD_SLOT, PAD_SLOT]
    with pytest.raises(ValueError, match="9 tokens in a bucket of 8"):
        inputs.fill([request("f", list(range(9)), [0, 1, 2])], bucket=8)


def test_staging_shares_one_buffer_per_operand_slot_across_layers_and_buckets():
    staging = StagingBuffers(8, torch.device("cpu"))
    a, b = torch.randn(5, 2, 3), torch.randn(5, 4)
    staged = staging.stage((a, b))
    assert [tuple(s.shape) for s in staged] == [(5, 2, 3), (5, 4)]
    assert torch.equal(staged[0], a) and torch.equal(staged[1], b)
    again = staging.stage((torch.ones(3, 2, 3), torch.zeros(3, 4)))  # another layer, bucket
    assert again[0].data_ptr() == staged[0].data_ptr()  # the same buffer
    assert len(staging.buffers) == 2


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_a_padded_mixed_step_gives_the_eager_hidden_states_and_cache(family):
    """Two decodes and a chunk over a cached prefix (7 tokens) in a bucket of 32, against the
    same step run eagerly: the real rows agree to rounding (padding makes each GEMM taller, and
    CPU matmuls round differently for other heights), and padding writes no cache slot."""
    model, caches = make_model(family)
    prompts, tables = [[5, 9, 2, 7, 1], [3, 4, 8], [6, 6, 1, 2, 9, 10]], [[0, 1], [2], [3, 4, 5]]
    prefill(model, caches, prompts, tables)
    step = [
        request("a", [20], tables[0], start=5),
        request("b", [21], tables[1], start=3),
        request("c", [30, 31, 32, 33, 34], tables[2], start=6),  # positions 6..10
    ]
    before = [cache.clone() for cache in caches]
    graph_caches = [cache.clone() for cache in caches]
    graphs = PiecewiseGraphs(model, graph_caches, 32, BLOCK_SIZE, torch.device("cpu"))
    assert graphs.bucket_of(step) == 32
    with torch.inference_mode():
        padded = graphs.run(step, 32)  # [7, H]
        attn = build_attention_metadata([1, 1, 5], [6, 4, 11], tables, BLOCK_SIZE)
        ids = torch.tensor([20, 21, 30, 31, 32, 33, 34])
        positions = torch.tensor([5, 3, 6, 7, 8, 9, 10])
        eager = model(ids, positions, ForwardContext(attn, caches))
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=0, atol=1e-5)
    written = [1 * BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 3] + [
        tables[2][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(6, 11)
    ]
    assert_only_slots_written(graph_caches, caches, before, written, dict(rtol=0, atol=1e-5))


def test_models_whose_attention_selects_on_the_host_are_not_cut():
    assert cuts_every_attention(make_model("deepseek_v3")[0])
    assert cuts_every_attention(make_model("llama")[0])
    dsa = ModelConfig.from_hf_dict(dict(TINY_DSA, architectures=["DeepseekV32ForCausalLM"]))
    graphs = cuda_graph_config(True, is_cuda=True, plan=ParallelPlan(), max_num_seqs=8,
                               max_graph_batch_size=8, max_model_len=64, model=dsa,
                               max_piecewise_tokens=64)  # fmt: skip
    assert graphs.max_piecewise_tokens == 0


def test_runner_sends_other_steps_to_the_pieces_and_pure_decodes_to_decode_graphs(monkeypatch):
    config = ModelConfig.from_hf_dict(HF_CONFIGS["deepseek_v3"])
    graphs = CudaGraphConfig(max_batch_size=4, max_model_len=64, max_piecewise_tokens=16)
    runner = ModelRunner(config, rayinfer.engine_config.CacheConfig(BLOCK_SIZE, 32), "cpu",
                         torch.float32, load_format="dummy", cuda_graphs=graphs)  # fmt: skip
    assert runner.piecewise_graphs.sizes == [16]
    calls = []
    run = runner.piecewise_graphs.run
    monkeypatch.setattr(
        runner.piecewise_graphs,
        "run",
        lambda reqs, bucket, *hook: calls.append((len(reqs), bucket)) or run(reqs, bucket, *hook),
    )
    two = [request("a", [1, 2, 3], [0]), request("b", [4, 5], [1])]
    assert len(runner.execute(ModelBatch(two))) == 2
    mixed = [request("a", [6], [0], start=3), request("c", [7, 8, 9], [2])]
    assert len(runner.execute(ModelBatch(mixed))) == 2
    assert calls == [(2, 16), (2, 16)]
    runner.execute(ModelBatch([request("a", [7], [0, 3], start=4)]))  # a pure decode: its graph
    runner.execute(ModelBatch([request("d", list(range(1, 18)), [4, 5, 6, 7, 8])]))  # 17 tokens
    runner.piecewise_graphs.enabled = False
    runner.execute(ModelBatch(two))
    assert calls == [(2, 16), (2, 16)]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_moe"])
def test_llm_with_piecewise_graphs_generates_the_eager_tokens(family, tmp_path, monkeypatch):
    """Five prompts, chunked beside each other's decodes under an 8-token budget; their
    max_tokens differ, so the step mixes change as they finish."""
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[family]))
    prompts = [[5, 9, 2, 7, 1, 3, 4], [3, 4, 8], list(range(1, 20)), [8, 8, 1], [2] * 11]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 4, 7, 2, 5)]
    outputs, pieces = {}, []
    for cuda_graphs in (False, True):
        llm = rayinfer.LLM(str(tmp_path), device="cpu", load_format="dummy", max_num_seqs=4,
                           cuda_graphs=cuda_graphs, block_size=BLOCK_SIZE,
                           max_num_batched_tokens=8, max_graph_prefill_tokens=0)  # fmt: skip
        graphs = llm.engine.executor.runner.piecewise_graphs
        assert (graphs is not None) == cuda_graphs
        if graphs is not None:
            assert graphs.sizes == [8]  # capped by the step's budget
            counted = lambda r, b, *h, run=graphs.run: pieces.append(b) or run(r, b, *h)  # noqa: E731
            monkeypatch.setattr(graphs, "run", counted)
        outputs[cuda_graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    assert len(pieces) > 5  # most steps mixed decodes with chunks


def test_piecewise_graph_tokens_are_capped_and_checked():
    def resolve(max_piecewise_tokens):
        return cuda_graph_config(True, is_cuda=True, plan=ParallelPlan(), max_num_seqs=8,
                                 max_graph_batch_size=8, max_model_len=1024,
                                 max_piecewise_tokens=max_piecewise_tokens)  # fmt: skip

    assert resolve(4096).max_piecewise_tokens == 4096
    with pytest.raises(ConfigError, match="max_graph_piecewise_tokens=-1 must be >= 0"):
        resolve(-1)
    llm = rayinfer.LLM("tiny", device="cpu", cuda_graphs=True, max_num_batched_tokens=512)
    assert llm.spec.cuda_graphs.max_piecewise_tokens == 512  # capped by the step's budget
    off = rayinfer.LLM("tiny", device="cpu", cuda_graphs=True, max_graph_piecewise_tokens=0)
    assert off.engine.executor.runner.piecewise_graphs is None
