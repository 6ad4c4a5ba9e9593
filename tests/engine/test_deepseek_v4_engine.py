"""DeepSeek-V4 in the offline engine: transformers' greedy tokens through continuous batching,
chunked prefill, the prefix cache, preemption and the prefill -> decode hand-off into a cache of
another block size, and the decode graphs' static inputs. Every path must carry the hybrid cache
(config_v4.py): the window pool's keys and compressor projections of a sequence's last tokens,
and the pooled entries spread over the paged cache's rows."""

import pytest

import rayinfer
from tests.models.harness import make_prompts, make_v4_checkpoint, run_transformers

NUM_TOKENS = 16
GREEDY = rayinfer.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_v4_checkpoint(tmp_path_factory.mktemp("v4")))


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


def test_shared_prefix_reuses_cached_rows_and_their_pooled_entries(checkpoint, prompts):
    llm = rayinfer.LLM(checkpoint, device="cpu", block_size=4)
    llm.generate(prompts[3], GREEDY)  # 40 tokens: 10 full blocks enter the cache
    variant = prompts[3][:30] + [1, 2, 3]  # the prefix ends inside a CSA group and an HCA one
    output = llm.generate(variant, GREEDY)[0]
    assert output.num_cached_tokens == 28
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
    path a GPU captures (every token pooled, only closing windows written, padding rows' slots
    skipped, the context bounded by the tables' width)."""
    llm = rayinfer.LLM(checkpoint, device="cpu", cuda_graphs=True, max_graph_batch_size=8)
    graphs = llm.engine.executor.runner.decode_graphs
    replays, run = [], graphs.run
    graphs.run = lambda requests, bucket=None: replays.append(bucket) or run(requests, bucket)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert replays and llm.engine.executor.runner.prefill_graphs is None


def test_a_window_pool_for_two_sequences_slides_and_reuses_its_blocks(checkpoint, prompts,
                                                                      expected):  # fmt: skip
    llm = rayinfer.LLM(checkpoint, device="cpu", block_size=4, max_num_seqs=2,
                       max_num_batched_tokens=16)  # fmt: skip
    manager = llm.engine.block_managers[0]
    pool = manager.window_pool
    # two sequences' last window_span (8) tokens in blocks of 4, plus a step's 16 new tokens
    assert len(pool.blocks) == llm.cache_config.num_window_blocks == 2 * (2 + 2) + 4
    outputs = llm.generate(prompts, GREEDY)  # 5 prompts of up to 40 + 16 tokens
    assert [o.token_ids for o in outputs] == expected
    assert pool.num_free == len(pool.blocks) and manager.num_free_blocks == len(manager.blocks)


def test_the_paged_cache_holds_entries_only(checkpoint):
    llm = rayinfer.LLM(checkpoint, device="cpu", block_size=4)
    config = llm.engine.model_config
    # TINY_V4 (D 32, index 16, CSA every 4, HCA every 8; layers sliding, CSA, HCA, CSA): each
    # layer a token's shares of its own type's entries, one column for the sliding layer
    widths = [1, 32 // 4 + 16 // 4, 32 // 8, 32 // 4 + 16 // 4]
    assert [shape for shape in config.kv_shapes_per_layer(4)] == [(w,) for w in widths]
    assert config.kv_bytes_per_token(4) == sum(widths) * 4
    runner = llm.engine.executor.runner
    entries, windows = runner.kv_cache.layers, runner.kv_cache.window_layers
    assert [cache.shape[1:] for cache in entries] == [(4, w) for w in widths]
    assert windows[0].shape[1:] == (4, 224)
    assert len(windows) == len(entries)
    assert windows[0].shape[0] == llm.cache_config.num_window_blocks
    assert runner.kv_bytes_per_token == sum(widths) * 4
    # a hand-off carries every layer's own row, unpadded: what the group reports it moves
    wire = runner.kv_cache.copier.token_bytes
    assert runner.kv_bytes_per_token == wire == sum(widths) * 4


def test_long_context_bench_reports_the_cache_as_allocated(checkpoint, tmp_path):
    """bench long_context reads the paged bytes per token and the window pool off the tensors."""
    import json

    from rayinfer.bench import long_context

    out = tmp_path / "long_context.json"
    argv = ["--config", checkpoint, "--lengths", "24", "--decode-batch", "0", "--chunk", "16"]
    argv += ["--decode-after-longest", "0", "--block-size", "4", "--dtype", "float32"]
    assert long_context.main([*argv, "--json", str(out)]) == 0
    cache = json.loads(out.read_text())["model"]["kv_cache"]
    config = rayinfer.LLM(checkpoint, device="cpu", block_size=4).engine.model_config
    assert cache["paged_bytes_per_token"] == config.kv_bytes_per_token(4)
    assert cache["window_pool_bytes"] > 0
