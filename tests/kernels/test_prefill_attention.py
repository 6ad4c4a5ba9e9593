"""Varlen causal flash attention (Triton, interpreter on CPU) against per-sequence SDPA."""

import pytest
import torch

from rayinfer.kernels.attention import prefill_attention as prefill_module
from rayinfer.kernels.attention.prefill_attention import (
    paged_prefill_attention,
    prefill_attention,
    prefill_attention_reference,
    split_head_dim,
)

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def run_varlen(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v, dtype, is_causal=True):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    query = randn(sum(q_lens), num_heads, dim_qk)
    key = randn(sum(k_lens), num_kv_heads, dim_qk)
    value = randn(sum(k_lens), num_kv_heads, dim_v)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).to(torch.int32)
    args = (cu_q, cu_k, max(q_lens), dim_qk**-0.5, is_causal)
    ours = prefill_attention(query, key, value, *args)
    reference = prefill_attention_reference(query.float(), key.float(), value.float(), *args)
    return ours, reference


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "q_lens,k_lens,num_heads,num_kv_heads,dim_qk,dim_v",
    [
        ([9, 20, 3], [9, 20, 3], 4, 2, 32, 32),  # plain prefill, GQA
        ([6, 1], [42, 1], 6, 6, 48, 32),  # chunks over a prefix; MLA-like split qk 32 + 16
        ([17], [33], 6, 1, 42, 20),  # odd dims: qk 32 + 10, value 20; MQA
    ],
    ids=["gqa-prefill", "mla-dims-chunk", "odd-dims-mqa"],
)
def test_varlen_matches_sdpa(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v, dtype):
    ours, reference = run_varlen(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v, dtype)
    assert ours.shape == (sum(q_lens), num_heads, dim_v) and ours.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


def test_single_token_and_non_causal():
    ours, reference = run_varlen([1], [1], 2, 2, 16, 16, torch.float32)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    ours, reference = run_varlen([5, 19], [12, 19], 2, 1, 16, 16, torch.float32, is_causal=False)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "q_lens,k_lens,is_causal",
    [([9, 20, 3], [9, 20, 3], True), ([6, 1], [42, 1], True), ([30, 4], [5, 19], False)],
    ids=["causal-prefill", "causal-chunk", "non-causal-more-queries-than-keys"],
)
def test_log_sum_exp_matches_reference(q_lens, k_lens, is_causal, dtype):
    """lse [T, Hq] float32 of each row's scaled scores (natural log), written beside out."""
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(sum(q_lens), 4, 48, generator=generator).to(dtype)
    key = torch.randn(sum(k_lens), 2, 48, generator=generator).to(dtype)
    value = torch.randn(sum(k_lens), 2, 32, generator=generator).to(dtype)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).to(torch.int32)
    args = (cu_q, cu_k, max(q_lens), 48**-0.5, is_causal)
    lse, expected_lse = torch.empty(sum(q_lens), 4), torch.empty(sum(q_lens), 4)
    out = torch.empty(sum(q_lens), 4, 32)  # float32 out for any input dtype: parts to merge
    prefill_attention(query, key, value, *args, out=out, lse=lse)
    operands = (query.float(), key.float(), value.float())
    expected = prefill_attention_reference(*operands, *args, lse=expected_lse)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, expected_lse, atol=tol, rtol=tol)


def test_log_sum_exp_must_be_float32_rows_of_heads():
    query = torch.randn(3, 2, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="lse"):
        prefill_attention(query, query, query, cu, cu, 3, 0.25, lse=torch.empty(3, 2).half())


@pytest.mark.parametrize("head_dim,split", [(128, (128, 0)), (192, (128, 64)), (42, (32, 10))])
def test_split_head_dim_spends_no_flops_on_padding(head_dim, split):
    assert split_head_dim(head_dim) == split


def test_mismatched_heads_name_the_fix():
    query, key = torch.randn(3, 6, 16), torch.randn(3, 4, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple of kv heads 4"):
        prefill_attention(query, key, key, cu, cu, 3, 1.0)


# ---- launch options (configs/prefill_attention.json keys), each against the same reference ----

VARIANTS = {
    "pointers": dict(),
    "heads-fastest": dict(HEADS_FASTEST=True),
    "pipelined": dict(PIPELINE_QK=True, BLOCK_M=32),
    "tma": dict(USE_TMA=True, HEADS_FASTEST=True),
    "tma-pipelined": dict(USE_TMA=True, PIPELINE_QK=True, WARP_SPECIALIZE=True),
    "conditional-rescale": dict(CONDITIONAL_RESCALE=True),
    "tma-ws-conditional-rescale": dict(
        USE_TMA=True, WARP_SPECIALIZE=True, CONDITIONAL_RESCALE=True
    ),
    "pipelined-conditional-rescale": dict(PIPELINE_QK=True, CONDITIONAL_RESCALE=True, BLOCK_M=32),
    # paged_prefill_attention's own tiles (contiguous K/V ignore them)
    "paged-tiles": dict(USE_TMA=True, paged=dict(BLOCK_M=32, BLOCK_N=16, CONDITIONAL_RESCALE=True)),
}


@pytest.fixture(params=list(VARIANTS))
def variant(request, monkeypatch):
    """Launch the kernel with the CPU tiles plus one variant's options."""
    original = prefill_module.launch_params

    def with_variant(op, device, bucket=1):
        return {**original(op, device, bucket), **VARIANTS[request.param]}

    monkeypatch.setattr(prefill_module, "launch_params", with_variant)
    return request.param


@pytest.mark.parametrize(
    "q_lens,k_lens,num_heads,num_kv_heads,dim_qk,dim_v,is_causal",
    [
        ([1], [1], 2, 2, 32, 32, True),  # one token
        ([5], [5], 2, 1, 32, 32, True),  # shorter than a block
        ([37, 1, 16, 50], [37, 1, 16, 50], 4, 2, 32, 32, True),  # odd, exact and ragged lengths
        ([21, 3], [70, 3], 2, 2, 48, 32, True),  # chunks over a prefix; MLA-like qk 32 + 16
        ([9, 33], [40, 33], 2, 1, 32, 16, False),  # non-causal
        ([17], [33], 6, 1, 42, 20, True),  # unaligned dims: TMA falls back to pointers
    ],
    ids=["one-token", "short", "odd-lengths", "mla-dims-chunk", "non-causal", "odd-dims"],
)
def test_variants_match_sdpa(variant, q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v,
                             is_causal):  # fmt: skip
    ours, reference = run_varlen(q_lens, k_lens, num_heads, num_kv_heads, dim_qk, dim_v,
                                 torch.float16, is_causal)  # fmt: skip
    torch.testing.assert_close(ours.float(), reference, atol=2e-3, rtol=2e-3)


def test_tma_needs_aligned_rows():
    aligned = torch.randn(8, 2, 32, dtype=torch.float16)
    assert prefill_module._tma_fits((aligned,), (16,))
    assert not prefill_module._tma_fits((torch.randn(8, 2, 42, dtype=torch.float16),), (32,))
    assert not prefill_module._tma_fits((aligned,), (4,))  # split column 8 bytes in


@pytest.mark.parametrize(
    "context_len,chunk_len,block_size", [(45, 45, 16), (70, 19, 16), (9, 1, 3)]
)
def test_paged_variants_match_sdpa(variant, context_len, chunk_len, block_size):
    """A chunk over a paged prefix (block tables shuffled): TMA falls back to pointers there."""
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, dim = 4, 2, 32
    query = torch.randn(chunk_len, num_heads, dim, generator=generator).half()
    key, value = (torch.randn(context_len, num_kv_heads, dim, generator=generator).half()
                  for _ in range(2))  # fmt: skip
    num_blocks = -(-context_len // block_size)
    table = torch.randperm(num_blocks + 2, generator=generator)[:num_blocks].to(torch.int32)
    cache = torch.zeros(num_blocks + 2, block_size, 2, num_kv_heads, dim, dtype=torch.float16)
    positions = torch.arange(context_len)
    cache[table[positions // block_size].long(), positions % block_size] = torch.stack(
        (key, value), dim=1
    )
    starts = torch.tensor([0, chunk_len], dtype=torch.int32)
    lens = torch.tensor([context_len], dtype=torch.int32)
    ours = paged_prefill_attention(query, cache, table[None], lens, starts, chunk_len, dim**-0.5)
    cu_k = torch.tensor([0, context_len], dtype=torch.int32)
    reference = prefill_attention_reference(query.float(), key.float(), value.float(), starts,
                                            cu_k, chunk_len, dim**-0.5)  # fmt: skip
    torch.testing.assert_close(ours.float(), reference, atol=2e-3, rtol=2e-3)


def test_configs_are_bucketed_by_qk_head_dim(monkeypatch):
    """configs/prefill_attention.json buckets are qk head dims: MLA's 192 gets its own tiles."""
    buckets = []
    original = prefill_module.launch_params

    def spy(op, device, bucket=1):
        buckets.append(bucket)
        return original(op, device, bucket)

    monkeypatch.setattr(prefill_module, "launch_params", spy)
    run_varlen([3], [3], 2, 2, 48, 32, torch.float32)
    run_varlen([3], [3], 2, 2, 32, 32, torch.float32)
    assert buckets == [48, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "options",
    [
        dict(CONDITIONAL_RESCALE=True),
        dict(CONDITIONAL_RESCALE=True, PIPELINE_QK=True),
        dict(CONDITIONAL_RESCALE=True, USE_TMA=True, WARP_SPECIALIZE=True),
    ],
    ids=["plain", "pipelined", "tma-ws"],
)
def test_conditional_rescale_is_exact_when_the_max_jumps(monkeypatch, dtype, options):
    """Logits that grow along the context (by more than the threshold over some key tiles, by
    less over others) take both branches: skipped rescales and real ones, same result."""
    original = prefill_module.launch_params
    monkeypatch.setattr(
        prefill_module,
        "launch_params",
        lambda op, device, bucket=1: {**original(op, device, bucket), **options},
    )
    generator = torch.Generator().manual_seed(0)
    seq_len, num_heads, dim = 80, 2, 32
    query = torch.randn(seq_len, num_heads, dim, generator=generator)
    key = torch.randn(seq_len, num_heads, dim, generator=generator)
    value = torch.randn(seq_len, num_heads, dim, generator=generator)
    # 16x16 CPU tiles: with this growth the max moves by > 8 (log2) in some tiles, not others
    key = key * torch.linspace(0.5, 5.0, seq_len)[:, None, None]
    query, key, value = (t.to(dtype) for t in (query, key, value))
    cu = torch.tensor([0, seq_len], dtype=torch.int32)
    ours = prefill_attention(query, key, value, cu, cu, seq_len, dim**-0.5)
    reference = prefill_attention_reference(query.float(), key.float(), value.float(), cu, cu,
                                            seq_len, dim**-0.5)  # fmt: skip
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


def test_warp_specialization_only_with_tma():
    """The pointer paths (paged K/V, unaligned rows) never get `warp_specialize`."""
    options = dict(USE_TMA=True, WARP_SPECIALIZE=True, CONDITIONAL_RESCALE=True)
    aligned = (torch.randn(8, 2, 32, dtype=torch.float16),)
    contiguous = prefill_module._launch_options(options, aligned, (32,), is_paged=False)
    assert contiguous["WARP_SPECIALIZE"] and contiguous["CONDITIONAL_RESCALE"]
    paged = prefill_module._launch_options(options, aligned, (32,), is_paged=True)
    assert not paged["USE_TMA"] and not paged["WARP_SPECIALIZE"] and paged["CONDITIONAL_RESCALE"]


def test_paged_tiles_apply_to_paged_kv_only(monkeypatch):
    """A config's "paged" entry overrides tiles and options for paged K/V, not contiguous K/V."""
    original = prefill_module.launch_params
    paged = dict(BLOCK_N=32, CONDITIONAL_RESCALE=True)
    monkeypatch.setattr(
        prefill_module,
        "launch_params",
        lambda op, device, bucket=1: {**original(op, device, bucket), "paged": paged},
    )
    seen = []
    launch_options = prefill_module._launch_options

    def spy(params, tensors, column_offsets, is_paged):
        seen.append((is_paged, params["BLOCK_N"], params.get("CONDITIONAL_RESCALE", False)))
        return launch_options(params, tensors, column_offsets, is_paged)

    monkeypatch.setattr(prefill_module, "_launch_options", spy)
    run_varlen([3], [3], 2, 2, 32, 32, torch.float32)
    query = torch.randn(3, 2, 32)
    cache = torch.randn(2, 4, 2, 2, 32)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lens, starts = torch.tensor([6], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    paged_prefill_attention(query, cache, table, lens, starts, 3, 32**-0.5)
    default_block_n = original("prefill_attention", torch.device("cpu"), 32)["BLOCK_N"]
    assert default_block_n != 32 and seen == [(False, default_block_n, False), (True, 32, True)]


def test_register_cap_is_a_cuda_launch_option_only(monkeypatch):
    """A config's "maxnreg" reaches the CUDA launch as Triton's option; the interpreter (CPU)
    and configs without one (or with None, as the sweep writes) launch without it."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert prefill_module._register_cap({"maxnreg": 128}, cuda) == {"maxnreg": 128}
    assert prefill_module._register_cap({"maxnreg": 128}, cpu) == {}
    assert prefill_module._register_cap({"maxnreg": None}, cuda) == {}
    assert prefill_module._register_cap({}, cuda) == {}
    original = prefill_module.launch_params
    monkeypatch.setattr(
        prefill_module,
        "launch_params",
        lambda op, device, bucket=1: {**original(op, device, bucket), "maxnreg": 128},
    )
    run_varlen([5, 3], [9, 3], 2, 1, 32, 32, torch.float32)  # a capped config runs on the CPU


def test_the_gluon_backend_falls_back_where_it_does_not_apply(monkeypatch):
    """A config naming the warp-specialized Gluon kernel (the H200's 128 bucket) still serves
    what that kernel cannot: CPU tensors here (it needs an sm_90 GPU, bf16, head dim 128)."""
    from rayinfer.kernels.attention import prefill_attention_hopper

    query = torch.randn(5, 2, 128, dtype=torch.bfloat16)
    assert not prefill_attention_hopper.supports(query, query, query)
    original = prefill_module.launch_params
    monkeypatch.setattr(
        prefill_module,
        "launch_params",
        lambda op, device, bucket=1: {**original(op, device, bucket), "backend": "gluon_ws"},
    )
    run_varlen([5, 3], [9, 3], 2, 1, 32, 32, torch.float32)


def test_the_kernel_backends_pin_the_triton_kernel():
    """KernelBackends.prefill_attention="triton" overrides a config's Gluon backend; auto keeps
    it; another value fails, naming the key and the valid values."""
    from rayinfer.kernels.backends import KernelBackends

    assert prefill_module._backend({"backend": "gluon_ws"}, "auto") == "gluon_ws"
    assert prefill_module._backend({}, "auto") == "triton"
    assert prefill_module._backend({"backend": "gluon_ws"}, "triton") == "triton"
    with pytest.raises(ValueError, match=r"kernels\.prefill_attention='gluon'; use one of auto"):
        KernelBackends(prefill_attention="gluon")


def test_a_gluon_kernel_that_does_not_build_hands_over_to_triton(monkeypatch, caplog):
    """Another Triton's Gluon may not build the warp-specialized kernel: the failure is logged
    once and the Triton kernel answers this call and the later ones."""
    from triton.runtime.errors import OutOfResources

    from rayinfer.kernels import gluon_compat
    from rayinfer.kernels.attention import prefill_attention_hopper

    monkeypatch.setattr(gluon_compat, "HAS_GLUON", True)
    monkeypatch.setattr(gluon_compat, "_FAILED", set())
    original = prefill_module.launch_params
    monkeypatch.setattr(
        prefill_module,
        "launch_params",
        lambda op, device, bucket=1: {**original(op, device, bucket), "backend": "gluon_ws"},
    )
    monkeypatch.setattr(prefill_attention_hopper, "supports", lambda *args: True)
    attempts = []

    def does_not_build(*args):
        attempts.append(1)
        raise OutOfResources(240_000, 232_448, "shared memory")

    monkeypatch.setattr(prefill_attention_hopper, "prefill_attention_ws", does_not_build)
    with caplog.at_level("WARNING", logger=gluon_compat.__name__):
        for _ in range(2):
            ours, reference = run_varlen([5, 3], [9, 3], 2, 1, 32, 32, torch.float32)
            torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert attempts == [1]
    assert [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()]


def test_rope_columns_kept_apart_give_the_joined_result():
    """MLA's rope columns passed apart (a key rope shared by the heads) score like the joined
    query and key; out is written in place. Off Hopper they are joined for the Triton kernel."""
    generator = torch.Generator().manual_seed(4)
    query, query_rope = torch.randn(12, 4, 32, generator=generator), torch.randn(12, 4, 16)
    key, key_rope = torch.randn(12, 2, 32, generator=generator), torch.randn(12, 1, 16)
    value = torch.randn(12, 2, 24, generator=generator)
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    args = (cu_seqlens, cu_seqlens, 7, 0.25)
    joined_key = torch.cat([key, key_rope.expand(-1, 2, -1)], -1)
    joined = prefill_attention(torch.cat([query, query_rope], -1), joined_key, value, *args)
    out = torch.empty(12, 4, 24)
    apart = prefill_attention(query, key, value, *args, query_rope=query_rope, key_rope=key_rope,
                              out=out)  # fmt: skip
    assert apart.data_ptr() == out.data_ptr()
    torch.testing.assert_close(apart, joined, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="go together"):
        prefill_attention(query, key, value, *args, query_rope=query_rope)
