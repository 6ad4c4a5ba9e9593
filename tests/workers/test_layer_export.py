"""The hand-off's export during the prefill step (workers/runner/layer_export.py), on the CPU:
every model's forward announces each layer once that layer's rows are in the cache and before the
next layer writes (eagerly, and in pieces); the layer-by-layer copy lands the same bytes as the
whole-request export whichever layers were announced; what no export takes gives its span back.
The GPU's copy-engine path is tested in tests/gpu/test_kv_copy.py; between real worker groups,
tests/workers/test_async_handoff.py checks that a prefill worker's export went this way."""

from __future__ import annotations

import pytest
import torch

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine_config import KVHandoffConfig
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.models.dummy import build_dummy_model
from rayinfer.workers.handoff_io import HandoffIO
from rayinfer.workers.runner.kv_cache import KVCache
from rayinfer.workers.runner.kv_transfer import arena_chunks
from rayinfer.workers.runner.piecewise_graphs import PiecewiseGraphs
from tests.engine.test_decode_graphs import BLOCK_SIZE, HF_CONFIGS
from tests.models.harness import TINY_DSA

FAMILIES = {**HF_CONFIGS, "glm_moe_dsa": dict(TINY_DSA, architectures=["GlmMoeDsaForCausalLM"])}
PROMPT = [5, 9, 2, 7, 1, 3, 8, 6, 4]
TABLE = [3, 0, 5]  # 9 tokens in blocks of 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def make_model(family: str):
    config = ModelConfig.from_hf_dict(FAMILIES[family])
    model = build_dummy_model(config, torch.float32, "cpu", std=0.1)
    caches = [torch.zeros(8, BLOCK_SIZE, *shape) for shape in config.kv_shapes_per_layer(4)]
    return config, model, caches


def prompt_slots() -> torch.Tensor:
    positions = torch.arange(len(PROMPT))
    return torch.tensor(TABLE)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


class Listener:
    """Records, at each announcement, whether that layer's rows at the prompt's slots are
    written and whether the next layer's still are not."""

    def __init__(self, caches: list[torch.Tensor]):
        self.caches, self.slots = caches, prompt_slots()
        self.announced, self.written, self.next_untouched = [], [], []

    def rows(self, layer: int) -> torch.Tensor:
        return self.caches[layer].flatten(0, 1)[self.slots]

    def __call__(self, layer: int) -> None:
        self.announced.append(layer)
        self.written.append(bool((self.rows(layer) != 0).any(dim=-1).all()))
        if layer + 1 < len(self.caches):
            self.next_untouched.append(bool((self.rows(layer + 1) == 0).all()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_eager_forward_announces_each_layer_once_it_is_cached(family):
    config, model, caches = make_model(family)
    listener = Listener(caches)
    n = len(PROMPT)
    attn = build_attention_metadata([n], [n], [TABLE], BLOCK_SIZE)
    ctx = ForwardContext(attn, caches, on_layer_cached=listener)
    with torch.inference_mode():
        model(torch.tensor(PROMPT), torch.arange(n), ctx)
    assert listener.announced == list(range(config.num_layers))
    assert all(listener.written) and all(listener.next_untouched)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_forward_in_pieces_announces_each_layer_at_its_cut(family):
    config, model, caches = make_model(family)
    listener = Listener(caches)
    graphs = PiecewiseGraphs(model, caches, 16, BLOCK_SIZE, torch.device("cpu"))
    request = ScheduledRequest("p", PROMPT, 0, TABLE, True, GREEDY)
    with torch.inference_mode():
        graphs.run([request], graphs.bucket_of([request]), listener)
    assert listener.announced == list(range(config.num_layers))
    assert all(listener.written) and all(listener.next_untouched)


def random_cache(num_layers: int = 3) -> KVCache:
    """Layers of different widths (as DSA's and V4's), random rows."""
    torch.manual_seed(0)
    widths = [(6,), (4,), (6,)][:num_layers]
    layers = [torch.randn(8, BLOCK_SIZE, *width) for width in widths]
    return KVCache(layers, BLOCK_SIZE, kv_heads=None, chunk_bytes=4 * 16 * 4)  # 4-token chunks


def span_bytes(handoff: HandoffIO, header) -> torch.Tensor:
    return torch.cat([c.clone() for c in arena_chunks(handoff.arena.view(header.arena), header)])


@pytest.mark.parametrize("announced", [[], [1], [2, 0, 1]])
def test_layer_copies_land_the_whole_exports_bytes(tmp_path, announced):
    """Whichever layers the forward announced (none: a step replayed whole), the span holds
    what the whole-request export writes, and the header says how it went."""
    cache = random_cache()
    handoff = HandoffIO(is_cuda=False, config=KVHandoffConfig(arena_bytes=1 << 20))
    try:
        request = ScheduledRequest("r", PROMPT, 0, TABLE, True, GREEDY, exports_kv=True)
        copies = handoff.start_layer_exports(cache, [request])
        for layer in announced:
            copies.layer_cached(layer)
        copies.finish()
        state = torch.tensor([7, 7])
        layered = handoff.export(cache, TABLE, len(PROMPT), state, request_id="r")
        whole = handoff.export(cache, TABLE, len(PROMPT), state)
        assert layered.timings["way"] == "layers" and whole.timings["way"] == "host"
        assert layered.arena is not None and layered.arena != whole.arena
        assert layered.num_tokens == whole.num_tokens == len(PROMPT)
        assert layered.arena_chunk_tokens == whole.arena_chunk_tokens == 4
        assert torch.equal(layered.generator_state, state)
        assert torch.equal(span_bytes(handoff, layered), span_bytes(handoff, whole))
    finally:
        handoff.close()


def test_a_layer_export_no_export_takes_gives_its_span_back():
    cache = random_cache()
    handoff = HandoffIO(is_cuda=False, config=KVHandoffConfig(arena_bytes=1 << 20))
    try:
        requests = [
            ScheduledRequest(name, PROMPT, 0, TABLE, True, GREEDY, exports_kv=True)
            for name in ("ended", "other")
        ]
        handoff.start_layer_exports(cache, requests).finish()
        assert handoff.arena.num_held == 2
        handoff.drop_layer_exports(["ended", "unknown"])  # freed at its first token
        assert handoff.arena.num_held == 1 and list(handoff.layer_exports) == ["other"]
        # An export of another length (the prompt recomputed) takes the usual way.
        header = handoff.export(cache, TABLE, len(PROMPT) - 1, None, request_id="other")
        assert header.timings["way"] == "host" and not handoff.layer_exports
        assert handoff.arena.num_held == 1  # the new export's span alone
    finally:
        handoff.close()


def test_layer_by_layer_off_or_another_path_copies_after_the_step():
    cache = random_cache()
    request = ScheduledRequest("r", PROMPT, 0, TABLE, True, GREEDY, exports_kv=True)
    for config in (
        KVHandoffConfig(arena_bytes=1 << 20, layer_by_layer=False),
        KVHandoffConfig(path="object_store"),
    ):
        handoff = HandoffIO(is_cuda=False, config=config)
        try:
            assert handoff.start_layer_exports(cache, [request]) is None
        finally:
            handoff.close()


def test_where_ranks_cache_the_same_rows_only_the_exporting_one_copies_them_out():
    """MLA under tensor parallelism: every rank of a replica caches the same latent rows and the
    first alone exports them (WorkerGroup.export_kv), so the others get exports_kv off; ranks
    caching their own heads all export."""
    from types import SimpleNamespace

    from rayinfer.workers.group import WorkerGroup

    group = WorkerGroup.__new__(WorkerGroup)  # the wire's choice alone, no workers
    group.placements = [SimpleNamespace(dp_rank=rank // 2) for rank in range(4)]  # tp=2, dp=2
    ending = ScheduledRequest("e", PROMPT, 0, TABLE, True, GREEDY, exports_kv=True)
    other = ScheduledRequest("o", [1], 9, TABLE, True, GREEDY)
    group.kv_is_replicated = True
    flags = [
        [r.exports_kv for r in group._exporting_here(rank, [ending, other])] for rank in range(4)
    ]
    assert flags == [[True, False], [False, False], [True, False], [False, False]]
    group.kv_is_replicated = False
    assert all(group._exporting_here(rank, [ending])[0].exports_kv for rank in range(4))


def test_a_copy_that_cannot_be_issued_leaves_the_export_to_after_the_step(monkeypatch):
    """A refused copy (on GPUs the driver's batch copy) fails the layer export, not the step:
    the export after it copies the whole request."""
    from rayinfer.workers.runner import layer_export

    def refused(self, layer):
        raise RuntimeError("cuMemcpyBatchAsync failed (CUresult 1)")

    monkeypatch.setattr(layer_export.StepCopies, "_copy", refused)
    cache = random_cache()
    handoff = HandoffIO(is_cuda=False, config=KVHandoffConfig(arena_bytes=1 << 20))
    try:
        request = ScheduledRequest("r", PROMPT, 0, TABLE, True, GREEDY, exports_kv=True)
        copies = handoff.start_layer_exports(cache, [request])
        copies.layer_cached(0)
        copies.finish()
        header = handoff.export(cache, TABLE, len(PROMPT), None, request_id="r")
        assert header.timings["way"] == "host" and handoff.arena.num_held == 1
    finally:
        handoff.close()


def test_the_copy_size_for_batched_row_copies_comes_from_the_config():
    """kv_handoff's copy sizes reach the cache's copier before each export and import (on
    GPUs they decide between batched row copies and the staged kernels)."""
    cache = random_cache()
    config = KVHandoffConfig(export_direct_min_copy_bytes=1, import_direct_min_copy_bytes=2)
    handoff = HandoffIO(is_cuda=False, config=config)
    try:
        header = handoff.export(cache, TABLE, len(PROMPT), None)
        assert (cache.copier.export_min_copy_bytes, cache.copier.import_min_copy_bytes) == (1, 2)
        target = KVCache([torch.zeros_like(layer) for layer in cache.layers], BLOCK_SIZE, None)
        handoff.import_(target, TABLE, [header])
        assert target.copier.import_min_copy_bytes == 2
    finally:
        handoff.close()


def test_the_import_is_staged_by_default():
    assert KVHandoffConfig().import_direct_min_copy_bytes is None
    assert KVHandoffConfig(import_direct_min_copy_bytes=None).export_direct_min_copy_bytes > 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "64k"])
@pytest.mark.parametrize("key", ["export_direct_min_copy_bytes", "import_direct_min_copy_bytes"])
def test_a_bad_copy_size_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"kv_handoff.{key}="):
        KVHandoffConfig(**{key: value})
