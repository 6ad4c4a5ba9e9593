"""Decode CUDA graphs, the parts that run on the CPU: bucket choice, padding a batch to its bucket
and slicing back, the static input buffers, and the switch (LLM, Serve config). On the CPU the
padded static inputs run eagerly: padded steps must give exactly the unpadded hidden states and
write nothing into the KV cache for the padding rows."""

import pytest
import torch

import rayinfer
from rayinfer.config import ConfigError, ModelConfig, ParallelPlan
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.runtime import phase_graphs
from rayinfer.engine.batch import ModelBatch, ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.graph_config import CudaGraphConfig, cuda_graph_config
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.models.dummy import build_dummy_model
from rayinfer.workers.runner.decode_graphs import DecodeGraphs, shared_decode_bucket
from rayinfer.workers.runner.decode_inputs import PAD_SLOT, StaticDecodeInputs
from rayinfer.workers.runner.graph_buckets import bucket_for, graph_batch_sizes
from rayinfer.workers.runner.model_runner import ModelRunner
from tests.models.harness import TINY_DENSE, TINY_MLA

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
HF_CONFIGS = {
    "llama": dict(TINY_DENSE, architectures=["LlamaForCausalLM"]),
    "deepseek_v3": dict(TINY_MLA, architectures=["DeepseekV3ForCausalLM"], n_group=1, topk_group=1),
    "qwen3_moe": dict(
        TINY_DENSE,
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=16,
    ),
}


# --- buckets -----------------------------------------------------------------------------------
def test_bucket_sizes_double_then_step_by_eight_up_to_the_cap():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(256)[-3:] == [240, 248, 256]


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    sizes = graph_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    for too_many in (0, 21):
        with pytest.raises(ValueError, match="no graph bucket"):
            bucket_for(too_many, sizes)


# --- static inputs -----------------------------------------------------------------------------
def decode_request(name: str, token: int, start_position: int, table: list[int], samples=True):
    return ScheduledRequest(name, [token], start_position, table, samples, GREEDY)


def test_static_inputs_hold_the_batch_then_padding_that_writes_nothing():
    inputs = StaticDecodeInputs(8, 5, BLOCK_SIZE, kv_caches=[], device=torch.device("cpu"))
    requests = [decode_request("a", 11, 5, [3, 7]), decode_request("b", 12, 0, [2])]
    step = inputs.fill(requests, bucket=4)
    assert step.input_ids.tolist() == [11, 12, 0, 0]
    assert step.positions.tolist() == [5, 0, 0, 0]
    attn = step.ctx.attn
    assert attn.slot_mapping.tolist() == [7 * BLOCK_SIZE + 1, 2 * BLOCK_SIZE, PAD_SLOT, PAD_SLOT]
    assert attn.seq_lens.tolist() == [6, 1, 1, 1]
    assert (
        attn.block_tables.tolist()
        == [[3, 7, -1, -1, -1], [2, -1, -1, -1, -1]] + [[0, -1, -1, -1, -1]] * 2
    )
    assert attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert attn.query_lens_cpu == [1] * 4 and attn.seq_lens_cpu == [6, 1, 1, 1]
    for tensor in (attn.slot_mapping, attn.seq_lens, attn.block_tables, step.input_ids):
        assert tensor.is_contiguous()
    # A later, smaller step leaves no trace of the longer table in its rows.
    step = inputs.fill([decode_request("c", 13, 1, [4])], bucket=1)
    assert step.ctx.attn.block_tables.tolist() == [[4, -1, -1, -1, -1]]
    assert not inputs.fits(decode_request("d", 1, 24, [0] * 6))  # wider than max_model_len
    assert not inputs.fits(ScheduledRequest("e", [1, 2], 0, [0], True, GREEDY))  # a prefill


# --- padded runs on the CPU --------------------------------------------------------------------
def make_model(family: str):
    config = ModelConfig.from_hf_dict(HF_CONFIGS[family])
    model = build_dummy_model(config, torch.float32, "cpu", std=0.1)
    caches = [
        torch.zeros(64, BLOCK_SIZE, *config.kv_shape_per_token(4)) for _ in range(config.num_layers)
    ]
    return model, caches


def prefill(model, caches, prompts, tables):
    lengths = [len(p) for p in prompts]
    attn = build_attention_metadata(lengths, lengths, tables, BLOCK_SIZE)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lengths for i in range(n)])
    with torch.inference_mode():
        model(ids, positions, ForwardContext(attn, caches))


def eager_decode(model, caches, requests) -> torch.Tensor:
    attn = build_attention_metadata(
        [1] * len(requests),
        [r.seq_len for r in requests],
        [r.block_table for r in requests],
        BLOCK_SIZE,
    )
    ids = torch.tensor([r.token_ids[0] for r in requests])
    positions = torch.tensor([r.start_position for r in requests])
    with torch.inference_mode():
        return model(ids, positions, ForwardContext(attn, caches))


def token_slot(request: ScheduledRequest) -> int:
    position = request.start_position
    return request.block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_padded_decode_gives_the_unpadded_hidden_states_and_writes_no_padding(family):
    """3 decodes run in a bucket of 4 against the same 3 plus a 4th real one run eagerly (the
    same GEMM height: CPU matmuls round differently for 3 rows than for 4). Bit-exact without
    routed experts; the MoE reference multiplies each expert's rows as one GEMM, whose height
    the padding row's routing changes, so there the last bits may differ."""
    model, caches = make_model(family)
    prompts = [[5, 9, 2, 7, 1], [3, 4, 8], [6, 6, 1, 2, 9, 10, 11], [8, 3]]
    tables = [[0, 1], [2], [3, 4], [5]]
    prefill(model, caches, prompts, tables)
    requests = [
        decode_request(str(i), 20 + i, len(prompt), table)
        for i, (prompt, table) in enumerate(zip(prompts, tables))
    ]
    before = [cache.clone() for cache in caches]
    graph_caches = [cache.clone() for cache in caches]
    config = CudaGraphConfig(max_batch_size=8, max_model_len=32)
    graphs = DecodeGraphs(model, graph_caches, config, BLOCK_SIZE, torch.device("cpu"))
    with torch.inference_mode():
        padded = graphs.run(requests[:3])  # [3, H], run as a bucket of 4
    eager = eager_decode(model, caches, requests)  # [4, H]
    assert padded.shape == (3, eager.shape[1])
    exact = dict(rtol=0, atol=0) if family == "llama" else dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(padded, eager[:3], **exact)
    written = [token_slot(r) for r in requests[:3]]
    assert_only_slots_written(graph_caches, caches, before, written, exact)


def assert_only_slots_written(padded_caches, eager_caches, before, slots: list[int], tolerance):
    """The padded run wrote the eager run's K/V at these slots and nothing anywhere else."""
    for padded, eager, old in zip(padded_caches, eager_caches, before):
        padded_flat, eager_flat, old_flat = (c.flatten(0, 1) for c in (padded, eager, old))
        torch.testing.assert_close(padded_flat[slots], eager_flat[slots], **tolerance)
        untouched = torch.ones(padded_flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(padded_flat[untouched], old_flat[untouched])  # padding wrote nothing


def test_runner_sends_pure_decodes_to_the_graphs_and_the_rest_eagerly(monkeypatch):
    config = ModelConfig.from_hf_dict(HF_CONFIGS["llama"])
    graphs = CudaGraphConfig(max_batch_size=4, max_model_len=64)
    runner = ModelRunner(config, rayinfer.engine_config.CacheConfig(BLOCK_SIZE, 32), "cpu",
                         torch.float32, load_format="dummy", cuda_graphs=graphs)  # fmt: skip
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == [1, 2, 4]
    calls = []
    run = runner.decode_graphs.run
    monkeypatch.setattr(
        runner.decode_graphs,
        "run",
        lambda reqs, bucket=None: calls.append(len(reqs)) or run(reqs, bucket),
    )
    prompt = ScheduledRequest("a", [1, 2, 3], 0, [0], True, GREEDY)
    runner.execute(ModelBatch([prompt]))
    assert calls == []  # a prefill
    tokens = runner.execute(
        ModelBatch([decode_request("a", 4, 3, [0]), decode_request("b", 5, 0, [1])])
    )
    assert calls == [2] and len(tokens) == 2
    runner.decode_graphs.enabled = False
    runner.execute(ModelBatch([decode_request("a", 4, 4, [0, 2])]))
    assert calls == [2]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_llm_with_graphs_generates_the_eager_tokens(family, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[family]))
    prompts = [[5, 9, 2, 7, 1], [3, 4, 8], [6, 6, 1, 2, 9, 10, 11]]
    params = [  # one request also reports log-probabilities, read from the graph's logits
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=k)
        for n, k in ((9, None), (3, 2), (6, None))
    ]
    tokens, logprobs = {}, {}
    for cuda_graphs in (False, True):  # batches shrink 3 -> 2 -> 1: buckets 4, 2, 1
        llm = rayinfer.LLM(str(tmp_path), device="cpu", load_format="dummy", max_num_seqs=4,
                           cuda_graphs=cuda_graphs, block_size=BLOCK_SIZE)  # fmt: skip
        outputs = llm.generate(prompts, params)
        tokens[cuda_graphs] = [o.token_ids for o in outputs]
        logprobs[cuda_graphs] = [e.chosen.logprob for e in outputs[1].logprobs]
        assert (llm.graph_capture_seconds is not None) == cuda_graphs
    assert tokens[True] == tokens[False]
    assert logprobs[True] == pytest.approx(logprobs[False], abs=1e-5)


def test_group_agrees_on_one_bucket_for_every_replica():
    """The driver of a worker group picks the bucket of the largest replica's share; an empty
    share replays it on padding; any prefill, too-wide table or oversized share means eager."""
    sizes, width = [1, 2, 4, 8], 4
    decode = decode_request("a", 4, 3, [0])
    assert shared_decode_bucket([[decode] * 3, []], sizes, width) == 4
    assert shared_decode_bucket([[decode], [decode]], sizes, width) == 1
    assert shared_decode_bucket([[], []], sizes, width) is None  # nothing to run
    assert shared_decode_bucket([[decode] * 9, []], sizes, width) is None  # beyond the largest
    prefill = ScheduledRequest("p", [1, 2, 3], 0, [0], True, GREEDY)
    assert shared_decode_bucket([[decode], [prefill]], sizes, width) is None
    wide = decode_request("w", 4, 3, [0, 1, 2, 3, 5])
    assert shared_decode_bucket([[decode], [wide]], sizes, width) is None


# --- the switch --------------------------------------------------------------------------------
def test_graphs_default_on_for_cuda_where_the_forward_can_be_captured():
    def resolve(requested, is_cuda=True, plan=None, all_to_all=None):
        plan = plan or ParallelPlan()
        return cuda_graph_config(requested, is_cuda=is_cuda, plan=plan, max_num_seqs=64,
                                 max_graph_batch_size=32, max_model_len=1024,
                                 all_to_all=AllToAllConfig.of(all_to_all))  # fmt: skip

    assert resolve(None) == CudaGraphConfig(max_batch_size=32, max_model_len=1024)
    assert resolve(None, is_cuda=False) is None
    assert resolve(None, plan=ParallelPlan(dp=2)) is not None  # no collectives in the forward
    # All-reduces and the all-tokens exchange are captured as NCCL kernels.
    assert resolve(None, plan=ParallelPlan(tp=2)) is not None
    assert resolve(None, plan=ParallelPlan(dp=2, ep=2)) is not None
    # The host-staged exchange replays (two-state flags); the deduplicated one cannot (sized
    # from the routing on the host): auto turns graphs off for it...
    ep = ParallelPlan(dp=2, ep=2)
    assert resolve(None, plan=ep, all_to_all={"transport": "host"}) is not None
    assert resolve(True, plan=ep, all_to_all={"transport": "host"}) is not None
    assert resolve(None, plan=ep, all_to_all={"dedup": True}) is None
    # ...but only where experts exchange tokens (tp=2, ep=2 sums shares with an all-reduce).
    assert resolve(None, plan=ParallelPlan(tp=2, ep=2), all_to_all={"dedup": True})
    assert resolve(False) is None
    assert resolve(True, is_cuda=False) is not None  # the CPU runs the padded path eagerly
    with pytest.raises(ConfigError, match="all_to_all.dedup=true sizes the exchange"):
        resolve(True, plan=ep, all_to_all={"dedup": True})


def test_serve_config_takes_cuda_graphs_per_phase():
    config = AppConfig.from_args(
        {"decode.cuda_graphs": "false", "decode.max_graph_batch_size": "8"}
    )
    assert config.decode.cuda_graphs is False and config.decode.max_graph_batch_size == 8
    assert AppConfig.from_args({}).decode.cuda_graphs == "auto"
    assert AppConfig.from_args({"prefill.cuda_graphs": "on"}).prefill.cuda_graphs is True
    with pytest.raises(ConfigError, match=r"decode.cuda_graphs='maybe': use true, false or auto"):
        AppConfig.from_args({"decode.cuda_graphs": "maybe"})
    expected = r"decode.cuda_graphs=true cannot capture .* decode.all_to_all.dedup=true"
    with pytest.raises(ConfigError, match=expected):
        AppConfig.from_args(
            {"decode.cuda_graphs": True, "decode.dp": 2, "decode.ep": 2,
             "decode.all_to_all.dedup": "true"}
        )  # fmt: skip
    host = AppConfig.from_args(
        {"decode.cuda_graphs": True, "decode.dp": 2, "decode.ep": 2,
         "decode.all_to_all.transport": "host"}
    )  # fmt: skip
    assert phase_graphs(host.decode, "decode", use_gpus=True, max_model_len=4096) is not None
    # The all-tokens exchange over NCCL is captured: auto keeps decode graphs for dp=2 ep=2.
    ep = AppConfig.from_args({"decode.dp": 2, "decode.ep": 2})
    ep_graphs = phase_graphs(ep.decode, "decode", use_gpus=True, max_model_len=4096)
    assert ep_graphs is not None and ep_graphs.max_model_len == 4096
    auto = AppConfig.from_args({})
    decode = phase_graphs(auto.decode, "decode", use_gpus=True, max_model_len=4096)
    assert decode == CudaGraphConfig(max_batch_size=128, max_model_len=4096)
    # The prefill phase replays its new prompts and other steps in pieces (up to its step
    # budget) and no decode batch larger than 1 (its replicas stop after the first token).
    prefill = phase_graphs(auto.prefill, "prefill", use_gpus=True, max_model_len=4096)
    assert prefill == CudaGraphConfig(
        max_batch_size=1, max_model_len=4096, max_prefill_tokens=2048, max_piecewise_tokens=2048
    )
    engine = phase_graphs(auto.engine, "engine", use_gpus=True, max_model_len=4096)
    assert engine.max_prefill_tokens == engine.max_piecewise_tokens == 4096  # max_model_len
    no_pieces = AppConfig.from_args({"engine.max_graph_piecewise_tokens": "0"})
    assert phase_graphs(no_pieces.engine, "engine", True, 4096).max_piecewise_tokens == 0
    longer = AppConfig.from_args({"prefill.max_graph_prefill_tokens": "1024"})
    assert phase_graphs(longer.prefill, "prefill", True, 4096).max_prefill_tokens == 1024
    off = AppConfig.from_args({"prefill.cuda_graphs": "off"})
    assert phase_graphs(off.prefill, "prefill", use_gpus=True, max_model_len=4096) is None
    assert phase_graphs(auto.decode, "decode", use_gpus=False, max_model_len=4096) is None
