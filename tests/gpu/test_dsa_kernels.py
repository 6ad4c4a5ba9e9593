"""The DSA kernels on a GPU at GLM-5's shapes (64 heads, latent 512, rope 64, index_topk 2048;
indexer 32 heads x 128; cache rows [c_kv | k_pe | index key] 704 wide, blocks of 64), against
the float32 references over the same (rounded) inputs:

    python -m pytest -q -m gpu tests/gpu/test_dsa_kernels.py
"""

import pytest
import torch

from rayinfer.kernels.attention.paged_attention import launch_params
from rayinfer.kernels.dsa import dsa_indexer
from rayinfer.kernels.dsa.dsa_indexer import context_slots, dsa_index_topk, dsa_index_topk_reference
from rayinfer.kernels.dsa.radix_topk import radix_topk
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, LATENT_RANK, ROPE_DIM, TOPK = 64, 512, 64, 2048
INDEX_HEADS, INDEX_DIM, BLOCK_SIZE = 32, 128, 64
ROW_WIDTH = LATENT_RANK + ROPE_DIM + INDEX_DIM
ATTENTION_TOLERANCES = [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 1e-4)]
SCORE_TOLERANCES = [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)]  # of the largest score


def paged_cache(seq_lens, dtype, seed):
    """(kv_cache [blocks, 64, 704], block_tables [B, max_blocks] int32 over shuffled blocks)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = [-(-n // BLOCK_SIZE) for n in seq_lens]
    pool = torch.randperm(sum(counts), device="cuda", generator=generator).to(torch.int32)
    tables = torch.full((len(seq_lens), max(counts)), -1, dtype=torch.int32, device="cuda")
    for seq, start in enumerate(torch.tensor([0, *counts]).cumsum(0)[:-1].tolist()):
        tables[seq, : counts[seq]] = pool[start : start + counts[seq]]
    kv_cache = torch.randn(sum(counts), BLOCK_SIZE, ROW_WIDTH, device="cuda", generator=generator)
    return kv_cache.to(dtype), tables


def random_selection(seq_lens, tables, queries_per_seq, generator):
    """[T, 2048] int32: distinct slots of each query's context (-1 past a short one)."""
    rows = []
    for seq, seq_len in enumerate(seq_lens):
        for _ in range(queries_per_seq):
            chosen = torch.randperm(seq_len, device="cuda", generator=generator)[:TOPK]
            slots = tables[seq, chosen // BLOCK_SIZE].long() * BLOCK_SIZE + chosen % BLOCK_SIZE
            rows.append(torch.nn.functional.pad(slots, (0, TOPK - len(chosen)), value=-1))
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("dtype,tol", ATTENTION_TOLERANCES)
@pytest.mark.parametrize(
    "seq_lens,queries_per_seq",
    [([8192], 1), ([65536], 1), ([8192] * 16, 1), ([32768, 8192, 1000, 65536], 4), ([16384], 256)],
    ids=["decode-1x8k", "decode-1x64k", "decode-16x8k", "mixed-lengths", "prefill-256x16k"],
)
def test_sparse_mla_matches_float32_reference(seq_lens, queries_per_seq, dtype, tol):
    kv_cache, tables = paged_cache(seq_lens, dtype, seed=len(seq_lens))
    generator = torch.Generator(device="cuda").manual_seed(1)
    slots = random_selection(seq_lens, tables, queries_per_seq, generator)
    num_queries = slots.shape[0]
    q_latent = torch.randn(num_queries, HEADS, LATENT_RANK, device="cuda", generator=generator)
    q_pe = torch.randn(num_queries, HEADS, ROPE_DIM, device="cuda", generator=generator)
    q_latent, q_pe = q_latent.to(dtype), q_pe.to(dtype)
    scale = (LATENT_RANK // 4 + ROPE_DIM) ** -0.5  # GLM-5's qk head dim 192 + 64
    ours = sparse_mla_attention(q_latent, q_pe, kv_cache, slots, scale)
    reference = sparse_mla_attention_reference(
        q_latent.float(), q_pe.float(), kv_cache.float(), slots, scale
    )
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


def indexer_batch(seq_lens, query_lens, dtype, seed):
    kv_cache, tables = paged_cache(seq_lens, dtype, seed)
    generator = torch.Generator(device="cuda").manual_seed(seed + 1)
    query_seq = torch.cat([torch.full((q,), i, dtype=torch.int32, device="cuda")
                           for i, q in enumerate(query_lens)])  # fmt: skip
    positions = torch.cat([torch.arange(n - q, n, device="cuda")
                           for n, q in zip(seq_lens, query_lens)])  # fmt: skip
    num_queries = len(positions)
    q_index = torch.randn(num_queries, INDEX_HEADS, INDEX_DIM, device="cuda", generator=generator)
    weights = torch.randn(num_queries, INDEX_HEADS, device="cuda", generator=generator) * 0.01
    return (q_index.to(dtype), weights, kv_cache, LATENT_RANK + ROPE_DIM, tables, query_seq,
            positions, TOPK, max(seq_lens))  # fmt: skip


def chosen_scores(slots, args):
    """The reference scores (float32 over the same inputs) of each query's chosen slots, sorted
    (-inf for -1): selections compared by what they chose, whatever the ties."""
    q_index, weights, kv_cache, key_offset, tables, query_seq, positions, _, max_context = args
    context = context_slots(tables, query_seq, BLOCK_SIZE, max_context)  # [T, S]
    flat = kv_cache.view(-1, ROW_WIDTH)[:, key_offset : key_offset + INDEX_DIM].float()
    rows = []
    for t in range(len(positions)):  # one query at a time: [S, D] keys, not [T, S, D]
        keys = flat[context[t].clamp(min=0)]
        scores = (q_index[t].float() @ keys.t()).relu().t() @ weights[t]  # [S]
        by_slot = torch.full((len(flat),), float("-inf"), device="cuda")
        visible = torch.arange(max_context, device="cuda") <= positions[t]
        by_slot[context[t][visible]] = scores[visible]
        chosen = slots[t].long()
        picked = torch.where(chosen >= 0, by_slot[chosen.clamp(min=0)], float("-inf"))
        rows.append(picked.sort().values)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,tol", SCORE_TOLERANCES)
@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [([8192], [1]), ([65536], [1]), ([8192] * 16, [1] * 16), ([16384, 1500], [512, 1])],
    ids=["decode-1x8k", "decode-1x64k", "decode-16x8k", "chunk-512-over-16k-and-a-decode"],
)
def test_indexer_selects_what_the_reference_selects(seq_lens, query_lens, dtype, tol):
    args = indexer_batch(seq_lens, query_lens, dtype, seed=len(seq_lens))
    ours, reference = dsa_index_topk(*args), dsa_index_topk_reference(*args)
    assert torch.equal((ours < 0).sum(1), (reference < 0).sum(1))  # -1: past a short context
    ours_scores, ref_scores = chosen_scores(ours, args), chosen_scores(reference, args)
    scale = ref_scores[ref_scores.isfinite()].abs().max()
    torch.testing.assert_close(ours_scores, ref_scores, atol=tol * scale, rtol=0)


def test_indexer_at_a_million_tokens_keeps_its_scores_within_a_gibibyte():
    """512 queries of a prefill chunk at the end of a 1M-token context: scored 256 at a time, so
    the step's extra memory stays near 1 GiB; two of them checked against the reference."""
    seq_len, chunk = 1 << 20, 512
    args = indexer_batch([seq_len], [chunk], torch.bfloat16, seed=7)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours = dsa_index_topk(*args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= dsa_indexer.SCORE_BUFFER_BYTES * 1.25
    assert (ours >= 0).all()  # every query sees more than 2048 tokens
    rows = [0, chunk - 1]
    q_index, weights, kv_cache, key_offset, tables, query_seq, positions, topk, _ = args
    few = (q_index[rows], weights[rows], kv_cache, key_offset, tables, query_seq[rows],
           positions[rows], topk, seq_len)  # fmt: skip
    ours_scores = chosen_scores(ours[rows], few)
    ref_scores = chosen_scores(dsa_index_topk_reference(*few), few)
    scale = ref_scores.abs().max()
    torch.testing.assert_close(ours_scores, ref_scores, atol=1e-3 * scale, rtol=0)


@pytest.mark.parametrize(
    "num_rows,num_cols,k",
    [
        (1, 8192, 2048),
        (16, 131072, 2048),
        (64, 131072, 2048),
        (4, 1 << 20, 2048),
        (512, 16384, 2048),
        (3, 5000, 1),
    ],
    ids=["1x8k", "16x128k", "64x128k", "4x1M", "prefill-512x16k", "top-1"],
)
def test_radix_topk_picks_the_values_torch_topk_picks(num_rows, num_cols, k):
    """The selection's kernel at decode and prefill sizes, with -inf tails (causal masking) and
    ties (rounded scores): the same values as torch.topk, each column once."""
    generator = torch.Generator(device="cuda").manual_seed(num_rows)
    scores = torch.randn(num_rows, num_cols, device="cuda", generator=generator)
    scores = scores.round(decimals=2)  # many ties, some at the threshold
    scores[0, num_cols // 2 :] = float("-inf")
    out = torch.empty(num_rows, k, dtype=torch.int32, device="cuda")
    radix_topk(scores, k, out, launch_params("radix_topk", scores.device))
    chosen = scores.gather(1, out.long()).sort(-1).values
    assert torch.equal(chosen, scores.topk(k, dim=-1).values.sort(-1).values)
    distinct = out.sort(-1).values.diff(dim=-1)
    assert (distinct > 0).all()  # each column once


def hopper_only():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon sparse MLA kernel runs on sm_90 only")


GLUON_FORMS = [("gluon_ws", 64, 64), ("gluon_ws_tokens", 16, 16), ("gluon_ws_tokens", 32, 32),
               ("gluon_ws_tokens", 64, 20)]  # fmt: skip


@pytest.mark.parametrize("layout,block_h,num_heads", GLUON_FORMS,
                         ids=[f"{f}-{n}heads" for f, _, n in GLUON_FORMS])  # fmt: skip
@pytest.mark.parametrize("num_listed", [2048, 100, 1], ids=["k2048", "k100", "k1"])
def test_gluon_sparse_mla_matches_float32_reference(monkeypatch, layout, block_h, num_heads,
                                                    num_listed):  # fmt: skip
    """The Gluon split kernel (sparse_mla_hopper) in both forms, launched (counted), against
    float32: lists of 1, of 100 (a partial last tile) and of 2048 entries with -1 runs (a short
    context's padding, a whole tile of it, and one query with nothing listed), 37 queries."""
    hopper_only()
    from rayinfer.kernels.dsa import sparse_mla_hopper

    launches = []
    launch = sparse_mla_hopper.sparse_mla_ws_launch
    monkeypatch.setattr(sparse_mla_hopper, "sparse_mla_ws_launch",
                        lambda *a, **k: launches.append(k) or launch(*a, **k))  # fmt: skip
    seq_lens = [8192, 1000, 65536]
    kv_cache, tables = paged_cache(seq_lens, torch.bfloat16, seed=3)
    generator = torch.Generator(device="cuda").manual_seed(2)
    slots = random_selection(seq_lens, tables, 12, generator)[:, :num_listed]  # [36, K]
    slots = torch.cat([slots, torch.full_like(slots[:1], -1)])  # a query with nothing listed
    if num_listed == TOPK:
        slots[0, 64:192] = -1  # two whole tiles of -1 inside a list
    num_queries = slots.shape[0]
    q_latent = torch.randn(num_queries, num_heads, LATENT_RANK, device="cuda", generator=generator)
    q_pe = torch.randn(num_queries, num_heads, ROPE_DIM, device="cuda", generator=generator)
    q_latent, q_pe = q_latent.bfloat16(), q_pe.bfloat16()
    scale = (LATENT_RANK // 4 + ROPE_DIM) ** -0.5
    params = {**launch_params("sparse_mla", q_latent.device, num_heads), "layout": layout,
              "BLOCK_H": block_h, "BLOCK_N": 64, "whole_waves": True, "programs_per_sm": 1,
              "min_tokens_per_split": 64, "max_splits": 32}  # fmt: skip
    ours = sparse_mla_attention(q_latent, q_pe, kv_cache, slots, scale, params=params)
    reference = sparse_mla_attention_reference(
        q_latent.float(), q_pe.float(), kv_cache.float(), slots, scale
    )
    assert launches and launches[0]["tokens_major"] == (layout == "gluon_ws_tokens")
    assert not ours[-1].any()  # nothing listed: zeros (the reference's softmax has no entry)
    torch.testing.assert_close(ours[:-1].float(), reference[:-1], atol=2e-2, rtol=2e-2)
