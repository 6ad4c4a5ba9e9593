"""index_cache_dtype="fp8_e4m3": DSA models cache their indexer keys as FP8 e4m3 with one float32
scale per token. On the tiny DeepSeek-V3.2 and GLM-5 checkpoints (float32 on the CPU, index
keys 16 wide, index_topk 6): the engine generates with the narrower row (24 + 8 = 32
columns instead of 40), its selections mostly agree with the float32 keys', its tokens are those
of the model with FP8-rounded keys, the prefill -> decode hand-off moves the FP8 bytes unchanged,
and bad values fail naming the key."""

import pytest

import rayinfer
from rayinfer.config import ConfigError, ModelConfig
from rayinfer.kernels import ops
from rayinfer.kernels.dsa.dsa_index_fp8 import quantize_index_keys
from rayinfer.layers.dsa import LightningIndexer
from rayinfer.workers.runner.kv_memory import kv_bytes_per_block
from tests.models.harness import DSA_FAMILIES, make_dsa_checkpoint, make_prompts

NUM_TOKENS = 8
GREEDY = rayinfer.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
# float32 rows: 96 latent bytes + 16 + 4 key bytes padded to 128 (32 columns), or 24 + 16
FP8_ROW, FLOAT32_ROW = 32, 16 + 8 + 16


@pytest.fixture(scope="module", params=list(DSA_FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return str(make_dsa_checkpoint(folder, request.param, **DSA_FAMILIES[request.param]))


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(128, lengths=(23, 40, 31, 9))


def prefill_selections(checkpoint, prompts, monkeypatch, **kwargs):
    """(the cache row width, the selections [rows of slots] of every query that sees more than
    index_topk tokens, over one step that prefills every prompt)."""
    selections = []

    def recording(q_index, weights, kv_cache, key_offset, tables, seq, positions, topk, *rest):
        slots = select(q_index, weights, kv_cache, key_offset, tables, seq, positions, topk, *rest)
        selections.extend(set(row) for row, p in zip(slots.tolist(), positions) if p + 1 > topk)
        return slots

    select = ops.dsa_index_topk
    monkeypatch.setattr(ops, "dsa_index_topk", recording)
    llm = rayinfer.LLM(checkpoint, device="cpu", **kwargs)
    llm.generate(prompts, rayinfer.SamplingParams(max_tokens=1, temperature=0))
    monkeypatch.undo()
    return llm.engine.executor.runner.kv_caches[0].shape[-1], selections


def test_fp8_keys_shrink_the_row_and_select_mostly_the_same_tokens(
    checkpoint, prompts, monkeypatch
):
    """Over the prefill of these prompts, the queries past index_topk (DeepSeek-V3.2: 237 in
    its 3 layers, GLM-5: 158 in its 2 full ones) share 92.2% and 96.6% of their selected slots
    with the float32 keys' selection; asserted >= 90%. (The tiny models' greedy tokens have
    small margins: 3 of 4 first tokens agree, 0 and 1 of 4 eight-token outputs.)"""
    width, ours = prefill_selections(checkpoint, prompts, monkeypatch, index_cache_dtype="fp8_e4m3")
    reference_width, reference = prefill_selections(checkpoint, prompts, monkeypatch)
    assert (width, reference_width) == (FP8_ROW, FLOAT32_ROW)
    assert len(ours) == len(reference) > 100
    shared = sum(len(a & b) for a, b in zip(ours, reference))
    assert shared >= 0.9 * sum(len(b) for b in reference)
    outputs = rayinfer.LLM(checkpoint, device="cpu", index_cache_dtype="fp8_e4m3").generate(
        prompts, GREEDY
    )
    assert [len(o.token_ids) for o in outputs] == [NUM_TOKENS] * len(prompts)


def test_fp8_keys_give_the_tokens_of_the_model_with_fp8_rounded_keys(
    checkpoint, prompts, monkeypatch
):
    """The FP8 cache changes nothing but the keys' rounding: the float32 cache of a model whose
    indexer keys are rounded through FP8 (k_fp8 * scale, exact in float32) gives its tokens."""
    fp8 = rayinfer.LLM(checkpoint, device="cpu", index_cache_dtype="fp8_e4m3")
    expected = [o.token_ids for o in fp8.generate(prompts, GREEDY)]
    forward = LightningIndexer.forward

    def rounded_keys(self, positions, hidden, q_resid):
        queries, weights, keys = forward(self, positions, hidden, q_resid)
        fp8_keys, scale = quantize_index_keys(keys)
        return queries, weights, (fp8_keys.float() * scale[:, None]).to(keys.dtype)

    monkeypatch.setattr(LightningIndexer, "forward", rounded_keys)
    outputs = rayinfer.LLM(checkpoint, device="cpu").generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected


def test_hand_off_moves_fp8_rows_unchanged(checkpoint, prompts):
    """Prefill in blocks of 8, decode in blocks of 3: one engine's tokens (same bytes, same
    selections)."""
    fp8 = dict(device="cpu", index_cache_dtype="fp8_e4m3")
    expected = [o.token_ids for o in rayinfer.LLM(checkpoint, **fp8).generate(prompts, GREEDY)]
    prefill = rayinfer.LLM(checkpoint, block_size=8, **fp8)
    decode = rayinfer.LLM(checkpoint, block_size=3, **fp8)
    outputs = decode.decode(prefill.prefill(prompts, GREEDY), GREEDY)
    assert [o.token_ids for o in outputs] == expected


def test_cache_bytes_follow_the_fp8_row(checkpoint):
    """Layers that run the indexer keep the FP8 row; "shared" ones (GLM-5) the latent alone."""
    config = ModelConfig.from_pretrained(checkpoint).with_index_cache_dtype("fp8_e4m3")
    assert config.kv_shape_per_token(4) == (FP8_ROW,)
    assert config.kv_shape_per_token(2) == (24 + 16,)  # bf16: 48 + 20 bytes, padded to 80
    widths = [FP8_ROW if kind == "full" else 24 for kind in config.indexer_types]
    assert config.kv_shapes_per_layer(4) == tuple((w,) for w in widths)
    assert kv_bytes_per_block(config, 1, 4, 16) == sum(widths) * 4 * 16


@pytest.mark.parametrize(
    "model, value, message",
    [
        ("dsa", "fp8", "index_cache_dtype='fp8'; use one of auto, fp8_e4m3"),
        ("dsa", "float8", "index_cache_dtype='float8'; use one of auto, fp8_e4m3"),
        ("tiny", "fp8_e4m3", "index_cache_dtype='fp8_e4m3' is for DeepSeek Sparse Attention"),
    ],
)
def test_bad_values_fail_naming_the_key(checkpoint, model, value, message):
    with pytest.raises(ConfigError, match=message):
        rayinfer.LLM(checkpoint if model == "dsa" else model, index_cache_dtype=value)
