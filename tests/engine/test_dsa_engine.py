"""DeepSeek-V3.2 and GLM-5 in the offline engine: transformers' greedy tokens through continuous
batching, chunked prefill, the prefix cache, preemption and the prefill -> decode hand-off into a
cache of another block size. index_topk (6) is below the prompts, so each path must carry the
indexer keys it caches with the latents."""

import pytest

import rayinfer
from tests.models.harness import DSA_FAMILIES, make_dsa_checkpoint, make_prompts, run_transformers

NUM_TOKENS = 16
GREEDY = rayinfer.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(DSA_FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return str(make_dsa_checkpoint(folder, request.param, **DSA_FAMILIES[request.param]))


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(128, lengths=(5, 23, 3, 40, 9))


@pytest.fixture(scope="module")
def expected(checkpoint, prompts):
    """transformers' `generate`, each prompt alone."""
    return run_transformers(checkpoint, prompts, NUM_TOKENS).token_ids


def test_batch_and_chunked_prefill_give_transformers_tokens(checkpoint, prompts, expected):
    for budget in (2048, 7):  # whole prompts; 7-token chunks over their cached prefixes
        llm = rayinfer.LLM(checkpoint, device="cpu", max_num_batched_tokens=budget)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_preemption_under_a_tiny_cache_gives_the_same_tokens(checkpoint, prompts, expected):
    llm = rayinfer.LLM(checkpoint, device="cpu", block_size=4, num_kv_blocks=24, max_model_len=64)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected


def test_shared_prefix_reuses_cached_blocks_and_their_indexer_keys(checkpoint, prompts):
    llm = rayinfer.LLM(checkpoint, device="cpu", block_size=4)
    llm.generate(prompts[3], GREEDY)  # 40 tokens: 10 full blocks enter the cache
    variant = prompts[3][:32] + [1, 2, 3]
    output = llm.generate(variant, GREEDY)[0]
    assert output.num_cached_tokens == 32
    assert output.token_ids == run_transformers(checkpoint, [variant], NUM_TOKENS).token_ids[0]


def test_prefill_hands_off_into_a_cache_of_another_block_size(checkpoint, prompts, expected):
    prefill = rayinfer.LLM(checkpoint, device="cpu", block_size=8)
    decode = rayinfer.LLM(checkpoint, device="cpu", block_size=3)
    outputs = decode.decode(prefill.prefill(prompts, GREEDY), GREEDY)
    assert [o.token_ids for o in outputs] == expected


def test_decode_graphs_give_the_same_tokens_and_prefill_graphs_stay_off(
    checkpoint, prompts, expected
):
    """cuda_graphs=True on the CPU runs the decode graphs' padded static inputs eagerly: the
    path a GPU captures (rows and context bound made on the device, padding slots skipped)."""
    from rayinfer.config import ModelConfig, ParallelPlan
    from rayinfer.graph_config import cuda_graph_config

    model = ModelConfig.from_pretrained(checkpoint)
    sizes = dict(plan=ParallelPlan(), max_num_seqs=8, max_graph_batch_size=8, max_model_len=64)
    graphs = cuda_graph_config(None, is_cuda=True, model=model, max_prefill_tokens=64, **sizes)
    assert graphs.max_batch_size == 8 and graphs.max_prefill_tokens == 0
    llm = rayinfer.LLM(checkpoint, device="cpu", cuda_graphs=True, max_graph_batch_size=8)
    graphs = llm.engine.executor.runner.decode_graphs
    replays, run = [], graphs.run
    graphs.run = lambda requests, bucket=None: replays.append(bucket) or run(requests, bucket)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert replays and llm.engine.executor.runner.prefill_graphs is None


def test_long_context_bench_reports_dsa_against_its_dense_twin(checkpoint, tmp_path):
    import json

    from rayinfer.bench import long_context

    out = tmp_path / "long_context.json"
    argv = ["--config", checkpoint, "--lengths", "24", "40", "--dense-lengths", "40"]
    argv += ["--decode-batch", "2", "--decode-context", "20", "--decode-tokens", "3"]
    argv += ["--decode-after-longest", "2", "--chunk", "16", "--block-size", "4"]
    assert long_context.main([*argv, "--dtype", "float32", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [entry["tokens"] for entry in results["model"]["prefill"]] == [24, 40]
    assert results["model"]["prefill"][1]["decode_ms_per_token"] > 0
    assert results["dense"]["decode"]["batch"] == 2
    assert set(results["ratios"]) == {"prefill 40", "decode tok/s"}
