"""MLA kernels (Triton, interpreter on CPU) against the torch references."""

import pytest
import torch

from rayinfer.kernels.attention.paged_attention import causal_attention
from rayinfer.kernels.mla import mla_attention as mla

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def shuffled_tables(seq_lens, block_size, generator):
    counts = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(counts) + 2, generator=generator).to(torch.int32)
    tables = torch.full((len(seq_lens), max(counts)), -1, dtype=torch.int32)
    start = 0
    for seq, count in enumerate(counts):
        tables[seq, :count] = pool[start : start + count]
        start += count
    return tables, len(pool)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "seq_lens,num_heads,latent_rank,rope_dim,block_size",
    [
        ([1, 5, 37, 70], 5, 64, 16, 4),  # odd head count, splits over a short context
        ([3], 16, 32, 16, 16),  # a sequence shorter than a block
        ([50, 2], 20, 48, 8, 1),  # non-power-of-two latent, heads over two programs
    ],
)
def test_decode_matches_reference(seq_lens, num_heads, latent_rank, rope_dim, block_size, dtype):
    generator = torch.Generator().manual_seed(0)
    tables, num_blocks = shuffled_tables(seq_lens, block_size, generator)
    batch = len(seq_lens)
    kv_cache = torch.randn(num_blocks, block_size, latent_rank + rope_dim, generator=generator)
    q_latent = torch.randn(batch, num_heads, latent_rank, generator=generator)
    q_pe = torch.randn(batch, num_heads, rope_dim, generator=generator)
    scale = 0.1
    ours = mla.mla_decode_attention(
        q_latent.to(dtype), q_pe.to(dtype), kv_cache.to(dtype), tables, seq_lens, scale
    )
    reference = mla.mla_decode_attention_reference(
        q_latent, q_pe, kv_cache.to(dtype).float(), tables, seq_lens, scale
    )
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


LAYOUTS = {
    "tokens_major": dict(layout="tokens_major", BLOCK_N=32, BLOCK_H=64),
    "heads_major": dict(layout="heads_major", BLOCK_N=32, BLOCK_H=16),
    "shared": dict(layout="shared", BLOCK_N=16, BLOCK_H=16),
}


def run_decode_case(seq_lens, num_heads, latent_rank, rope_dim, block_size, dtype, params,
                    backend="auto"):  # fmt: skip
    """(ours, float32 reference) on one random case."""
    generator = torch.Generator().manual_seed(len(seq_lens) + num_heads)
    tables, num_blocks = shuffled_tables(seq_lens, block_size, generator)
    batch = len(seq_lens)
    kv_cache = torch.randn(num_blocks, block_size, latent_rank + rope_dim, generator=generator)
    q_latent = torch.randn(batch, num_heads, latent_rank, generator=generator)
    q_pe = torch.randn(batch, num_heads, rope_dim, generator=generator)
    args = (kv_cache.to(dtype), tables, seq_lens, 0.1)
    ours = mla.mla_decode_attention(
        q_latent.to(dtype), q_pe.to(dtype), *args, params=params, backend=backend
    )
    reference = mla.mla_decode_attention_reference(
        q_latent, q_pe, kv_cache.to(dtype).float(), tables, seq_lens, 0.1
    )
    return ours.float(), reference


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "seq_lens,num_heads,block_size,splits",
    [
        ([37], 16, 16, 64),  # odd context, several splits (ends mid-block, mid-tile)
        ([5], 3, 16, 1),  # shorter than one block; one split writes the output directly
        ([1, 200, 9, 64], 20, 4, 8),  # very different lengths, 20 heads: not a multiple of 16
        ([70, 33], 40, 8, 3),  # 40 heads: one 64-head tile (tokens-major), three of 16
    ],
)
def test_decode_layouts_match_reference(seq_lens, num_heads, block_size, splits, layout):
    params = dict(LAYOUTS[layout], max_splits=splits, min_tokens_per_split=16, target_programs=64)
    ours, reference = run_decode_case(seq_lens, num_heads, 32, 16, block_size, torch.float32,
                                      params)  # fmt: skip
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_with_a_graph_wide_table_and_a_padding_row(layout):
    """As in a decode graph: the block table is far wider than the contexts (most splits hold no
    tokens and are skipped) and a padding row has no context at all: it comes out as zeros."""
    generator = torch.Generator().manual_seed(3)
    seq_lens, width, block_size, heads = [5, 40, 0], 64, 4, 16
    tables = torch.randperm(3 * width, generator=generator).to(torch.int32).view(3, width)
    kv_cache = torch.randn(3 * width, block_size, 48, generator=generator)
    q_latent = torch.randn(3, heads, 32, generator=generator)
    q_pe = torch.randn(3, heads, 16, generator=generator)
    params = dict(LAYOUTS[layout], max_splits=16, min_tokens_per_split=16, target_programs=64)
    ours = mla.mla_decode_attention(q_latent, q_pe, kv_cache, tables, seq_lens, 0.1, params=params)
    reference = mla.mla_decode_attention_reference(
        q_latent[:2], q_pe[:2], kv_cache, tables[:2], seq_lens[:2], 0.1
    )
    torch.testing.assert_close(ours[:2], reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[2], torch.zeros_like(ours[2]))


@pytest.mark.parametrize("layout", ["tokens_major", "heads_major"])
def test_decode_head_groups_and_half_precision(layout):
    """80 heads over 16-head tiles: five head groups share each split's rows; fp16 inputs."""
    params = dict(LAYOUTS[layout], BLOCK_H=16, max_splits=4, min_tokens_per_split=16)
    ours, reference = run_decode_case([45, 17], 80, 64, 16, 16, torch.float16, params)
    torch.testing.assert_close(ours, reference, atol=2e-3, rtol=2e-3)


LAUNCH_OPTIONS = {
    "tma": dict(USE_TMA=True),
    "tma-warp-specialized": dict(USE_TMA=True, WARP_SPECIALIZE=True),
    "evict-first": dict(EVICT_FIRST=True),
    "tma-evict-first": dict(USE_TMA=True, EVICT_FIRST=True),
    "table-in-loop": dict(TABLE_IN_LOOP=True),
}


@pytest.mark.parametrize("layout", ["tokens_major", "heads_major"])
@pytest.mark.parametrize("options", list(LAUNCH_OPTIONS))
@pytest.mark.parametrize(
    "seq_lens,num_heads,block_size,block_n,splits",
    [
        ([37, 16, 3], 16, 16, 16, 3),  # full tiles, a partial last tile, a sequence of one tile
        ([70, 5, 64], 20, 32, 16, 4),  # two tiles per cache block; heads over two programs
        ([33], 16, 16, 32, 2),  # tiles wider than a block: TMA falls back to pointer loads
    ],
)
def test_decode_launch_options_match_reference(seq_lens, num_heads, block_size, block_n, splits,
                                               options, layout):  # fmt: skip
    knobs = dict(max_splits=splits, min_tokens_per_split=16, target_programs=64)
    params = dict(LAYOUTS[layout], BLOCK_N=block_n, BLOCK_H=16, **knobs, **LAUNCH_OPTIONS[options])
    ours, reference = run_decode_case(seq_lens, num_heads, 32, 16, block_size, torch.float32,
                                      params)  # fmt: skip
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_tma_fits_needs_tiles_inside_blocks_and_aligned_columns():
    slots = torch.randn(64, 48)
    assert mla.mla_tma_fits(slots, 32, 16, 16, dict(BLOCK_N=16))
    assert not mla.mla_tma_fits(slots, 32, 16, 16, dict(BLOCK_N=32))  # tile spans two blocks
    assert not mla.mla_tma_fits(torch.randn(64, 56), 48, 8, 16, dict(BLOCK_N=16))  # dims
    assert not mla.mla_tma_fits(torch.randn(64, 50)[:, :48], 32, 16, 16, dict(BLOCK_N=16))


def test_decode_launches_split_then_combine():
    """The sweep's separate launches give the same output as mla_decode_attention."""
    generator = torch.Generator().manual_seed(3)
    tables, num_blocks = shuffled_tables([40, 9], 16, generator)
    kv_cache = torch.randn(num_blocks, 16, 48, generator=generator)
    q_latent, q_pe = torch.randn(2, 16, 32, generator=generator), torch.randn(2, 16, 16)
    splits = dict(max_splits=3, min_tokens_per_split=16, target_programs=64)
    params = dict(LAYOUTS["tokens_major"], BLOCK_N=16, BLOCK_H=16, num_warps=4, num_stages=1,
                  **splits)  # fmt: skip
    seq_lens = torch.tensor([40, 9], dtype=torch.int32)
    out, launch_split, launch_combine = mla.mla_decode_launches(
        q_latent, q_pe, kv_cache.view(-1, 48), tables, seq_lens, 0.1, params, 16
    )
    assert launch_combine is not None
    launch_split()
    launch_combine()
    expected = mla.mla_decode_attention(q_latent, q_pe, kv_cache, tables, seq_lens, 0.1,
                                        params=params)  # fmt: skip
    torch.testing.assert_close(out, expected)


def joined_attention(q_nope, q_pe, k_nope, k_pe, value, scale, starts_q, starts_k):
    """Plain causal attention per sequence over the concatenated [nope, rope] query and key."""
    query = torch.cat([q_nope, q_pe], -1)
    key = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], -1)
    out = []
    for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
        out.append(causal_attention(query[q0:q1], key[k0:k1], value[k0:k1], scale))
    return torch.cat(out)


def mla_operands(query_len, seq_len, generator):
    """MLA's views: q_nope and q_pe split off one [q, N, 48] query, k_nope and value off one
    [s, N, 56] kv_b output, a [s, 1, 16] rope key shared by the heads."""
    query = torch.randn(query_len, 3, 48, generator=generator)  # 32 nope + 16 rope
    kv = torch.randn(seq_len, 3, 56, generator=generator)  # 32 nope + 24 value
    k_pe = torch.randn(seq_len, 1, 16, generator=generator)
    q_nope, q_pe = query.split([32, 16], -1)
    k_nope, value = kv.split([32, 24], -1)
    return q_nope, q_pe.contiguous(), k_nope, k_pe, value


@pytest.mark.parametrize("query_len,seq_len", [(7, 7), (3, 20), (1, 9)])
def test_prefill_attention_of_one_sequence_keeps_the_rope_apart(query_len, seq_len):
    """The last q of s tokens, causal; out is written in place."""
    operands = mla_operands(query_len, seq_len, torch.Generator().manual_seed(1))
    out = torch.full((query_len, 3, 24), float("nan"))
    result = mla.mla_prefill_attention(*operands, 0.2, out)
    assert result.data_ptr() == out.data_ptr()
    expected = joined_attention(*operands, 0.2, [0, query_len], [0, seq_len])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reference_out = torch.empty_like(out)
    mla.mla_prefill_attention_reference(*operands, 0.2, reference_out)
    torch.testing.assert_close(reference_out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "query_len,seq_len,is_causal", [(7, 7, True), (12, 5, False), (3, 20, False)]
)
def test_prefill_attention_of_a_context_block_gives_its_log_sum_exp(query_len, seq_len, is_causal):
    """A chunk's own rows (causal) or a block of earlier context (every key visible, more
    queries than keys too) with lse: the kernel's outputs and lse equal the reference's."""
    operands = mla_operands(query_len, seq_len, torch.Generator().manual_seed(3))
    results = []
    for attend in (mla.mla_prefill_attention, mla.mla_prefill_attention_reference):
        out, lse = torch.empty(query_len, 3, 24), torch.empty(query_len, 3)
        attend(*operands, 0.2, out, None, is_causal, lse)
        results.append((out, lse))
    (ours, ours_lse), (expected, expected_lse) = results
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_prefill_attention_of_packed_new_prompts():
    """Several new prompts (q = s each) in one call over device cu_seqlens."""
    lens = [5, 11, 2]
    operands = mla_operands(sum(lens), sum(lens), torch.Generator().manual_seed(2))
    starts = [0, 5, 16, 18]
    bounds = (torch.tensor(starts, dtype=torch.int32), max(lens))
    out = torch.empty(sum(lens), 3, 24)
    mla.mla_prefill_attention(*operands, 0.3, out, bounds)
    expected = joined_attention(*operands, 0.3, starts, starts)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_cache_is_exact_and_skips_padding(dtype):
    kv_c, k_pe = torch.randn(5, 24), torch.randn(5, 8)
    slots = torch.tensor([7, -1, 0, 11, 3])
    ours = torch.zeros(3, 4, 32, dtype=dtype)
    reference = torch.zeros(3, 4, 32, dtype=dtype)
    mla.mla_write_cache(ours, slots, kv_c, k_pe)
    mla.mla_write_cache_reference(reference, slots, kv_c, k_pe)
    assert torch.equal(ours, reference)
    assert torch.count_nonzero(ours.view(12, 32)[[1, 2, 4, 5, 6, 8, 9, 10]]) == 0


@pytest.mark.parametrize("layout", ["gluon_ws", "gluon_ws_tokens"])
@pytest.mark.parametrize("fallback", [None, dict(BLOCK_N=32, min_tokens_per_split=32)])
def test_the_gluon_layouts_fall_back_to_triton_tiles_off_hopper(layout, fallback):
    """Both forms of mla_decode_hopper (sm_90 and bf16 only) run the Triton heads-major kernel
    elsewhere: here, on the CPU; with the entry's "fallback" tiles where it has them, else its
    own."""
    from rayinfer.kernels.mla import mla_decode_hopper

    query = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    assert not mla_decode_hopper.supports(query, query[..., :64], query.view(-1, 512), 16, 64)
    params = dict(layout=layout, BLOCK_N=16, BLOCK_H=16, max_splits=4,
                  min_tokens_per_split=16, target_programs=64)  # fmt: skip
    if fallback:
        params["fallback"] = fallback
    ours, reference = run_decode_case([5, 40, 17], 4, 32, 16, 16, torch.float32, params)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_the_kernel_backends_pin_the_triton_kernel(monkeypatch):
    """KernelBackends.mla_decode="triton": a Gluon layout runs the entry's fallback Triton tiles
    without asking the Gluon kernel whether it could run; another value fails, naming the key
    and the valid values."""
    from rayinfer.kernels.backends import KernelBackends
    from rayinfer.kernels.mla import mla_decode_hopper

    def must_not_be_asked(*args):
        raise AssertionError("the Gluon kernel was considered")

    monkeypatch.setattr(mla_decode_hopper, "supports", must_not_be_asked)
    params = dict(layout="gluon_ws_tokens", BLOCK_N=64, BLOCK_H=16, max_splits=4,
                  min_tokens_per_split=64, target_programs=64,
                  fallback=dict(BLOCK_N=16, min_tokens_per_split=16))  # fmt: skip
    ours, reference = run_decode_case([5, 40, 17], 4, 32, 16, 16, torch.float32, params,
                                      backend="triton")  # fmt: skip
    with pytest.raises(ValueError, match=r"kernels\.mla_decode='gluon'; use one of auto, triton"):
        KernelBackends(mla_decode="gluon")
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_queries_from_a_batched_matmul_get_uniform_rows_for_the_gluon_kernel():
    """The engine's q_latent is a batched matmul's [N, B, L] output seen as [B, N, L]: its
    (sequence, head) rows are not one stride apart, which the Gluon kernel's 2-D TMA view needs;
    it gets a contiguous copy, queries that already step uniformly (q_pe: a slice of the
    projection's rows) go as they are."""
    from rayinfer.kernels.mla.mla_decode_hopper import rows_step_uniformly, with_uniform_rows

    q_latent = torch.randn(16, 3, 512).transpose(0, 1)  # [B=3, N=16, L]
    assert not rows_step_uniformly(q_latent)
    copied = with_uniform_rows(q_latent)
    assert rows_step_uniformly(copied) and torch.equal(copied, q_latent)
    q_pe = torch.randn(3, 16, 192)[..., 128:]  # [B, N, 64] inside wider rows
    assert rows_step_uniformly(q_pe) and with_uniform_rows(q_pe) is q_pe
    assert rows_step_uniformly(q_latent[:1])  # one sequence: its heads' rows


def test_the_combine_narrows_its_columns_only_for_few_rows():
    """COMBINE_MIN_PROGRAMS 132: one sequence's 16 heads reduce 64 latent columns a program (128
    programs), 32 sequences' whole rows (512 programs); COMBINE_BLOCK_L caps either."""
    from rayinfer.kernels.mla.mla_decode import combine_columns

    params = dict(COMBINE_MIN_PROGRAMS=132)
    assert combine_columns(16, 512, params) == 64
    assert combine_columns(8 * 16, 512, params) == 256
    assert combine_columns(32 * 16, 512, params) == 512
    assert combine_columns(32 * 16, 512, {}) == 512
    assert combine_columns(16, 512, dict(COMBINE_BLOCK_L=128)) == 128
    assert combine_columns(1, 512, dict(COMBINE_MIN_PROGRAMS=10_000)) == 64  # the floor


def test_a_gluon_split_kernel_that_does_not_build_hands_over_to_triton(monkeypatch, caplog):
    """The Gluon split kernel failing to build (another Triton's Gluon) is logged once; the
    entry's fallback Triton tiles answer that call and the later ones."""
    from triton.runtime.errors import OutOfResources

    from rayinfer.kernels import gluon_compat
    from rayinfer.kernels.mla import mla_decode_hopper

    monkeypatch.setattr(gluon_compat, "HAS_GLUON", True)
    monkeypatch.setattr(gluon_compat, "_FAILED", set())
    monkeypatch.setattr(mla_decode_hopper, "supports", lambda *args: True)
    attempts = []

    def does_not_build(*args, **kwargs):
        attempts.append(1)
        raise OutOfResources(240_000, 232_448, "shared memory")

    monkeypatch.setattr(mla_decode_hopper, "mla_decode_ws_launch", does_not_build)
    params = dict(layout="gluon_ws_tokens", BLOCK_N=64, BLOCK_H=16, max_splits=4,
                  min_tokens_per_split=64, target_programs=64,
                  fallback=dict(BLOCK_N=16, min_tokens_per_split=16))  # fmt: skip
    with caplog.at_level("WARNING", logger=gluon_compat.__name__):
        for _ in range(2):
            ours, reference = run_decode_case([5, 40, 17], 4, 32, 16, 16, torch.float32, params)
            torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert attempts == [1]
    assert [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()]


def test_the_triton_fallback_of_a_gluon_entry_is_the_tiles_it_had():
    """Where the Gluon kernel cannot run (another GPU, float32), the H200's 16-head entry runs
    the Triton tiles it shipped before, without the one-program-per-SM split policy."""
    from rayinfer.kernels.mla.mla_decode import triton_fallback
    from rayinfer.kernels.tile_configs import pick_tile_config

    shipped_before = dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=3,
                          target_programs=528, min_tokens_per_split=32, max_splits=256)  # fmt: skip
    for device in ("NVIDIA H200", "default"):
        entry = pick_tile_config("mla_attention", device, "default", 16)
        assert entry["layout"] == "gluon_ws_tokens" and entry["whole_waves"]
        tiles = triton_fallback(entry)
        assert tiles["layout"] == "heads_major" and "whole_waves" not in tiles
        assert "programs_per_sm" not in tiles
        assert {key: tiles[key] for key in shipped_before} == shipped_before
