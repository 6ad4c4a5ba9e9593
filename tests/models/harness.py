"""Parity harness: tiny random HF checkpoints, a rayinfer model driven step by step over a paged
cache, and transformers as the judge.

    path = make_hf_checkpoint(tmp_path, "llama", hidden_size=64, ...)
    assert_matches_transformers(path, prompts=make_prompts(vocab_size=128))

`run_greedy` is a miniature engine: every step batches each unfinished sequence's next chunk
(prefill chunks of up to `chunk_size` tokens, then one-token decodes) with contiguous block
tables, so one call covers plain prefill, chunked prefill over a cached prefix and mixed
prefill + decode batches (`start_steps` makes sequences join late).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rayinfer.config import ModelConfig
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.models.loader import load_model

TINY_DENSE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# DeepSeek V2/V3 shapes small enough for CPU parity tests (MLA with a dense first layer).
TINY_MLA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)


# DeepSeek-V3.2 / GLM-5: TINY_MLA with a query LoRA and an indexer wide enough (16 heads) that
# ReLU scores rarely tie at zero; index_topk 6 is below most test prompts' lengths.
TINY_DSA = dict(
    TINY_MLA,
    q_lora_rank=24,
    num_hidden_layers=3,
    n_shared_experts=1,
    index_topk=6,
    index_head_dim=16,
    index_n_heads=16,
)


def make_hf_checkpoint(
    folder: Path, model_type: str, seed: int = 0, std: float = 0.1, **config_kwargs
) -> Path:
    """Save a transformers model of `model_type` with fixed-seed weights into `folder`.

    transformers' own init (std 0.02) leaves argmax margins tiny; std ~0.1 makes greedy decoding
    decisive. Norm weights become 1 + noise so that they matter too.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config_kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_weights(model, seed, std)
    model.save_pretrained(folder)
    return Path(folder)


def reinit_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            is_norm = "norm" in name and param.dim() == 1
            param.copy_(1.0 + noise if is_norm else noise)


def make_prompts(vocab_size: int, lengths=(5, 11, 3, 17), seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@dataclass
class SequenceRun:
    tokens: list[int]  # prompt then generated
    prompt_len: int
    start_step: int
    num_computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, V]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class GreedyResult:
    prompt_logits: list[torch.Tensor]  # per prompt [prompt_len, V] float32
    token_ids: list[list[int]]  # per prompt, the generated tokens


def load_rayinfer(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    config = ModelConfig.from_pretrained(path)
    return load_model(config, dtype, device), config


def allocate_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype, device="cpu"
) -> list:
    """Per layer its cache, then (DeepSeek-V4) per layer a window cache of as many blocks: the
    window tables are then the block tables, and nothing is released."""
    shape = (num_blocks, block_size, *config.kv_shape_per_token(dtype.itemsize))
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
    if config.window_span:
        window = (num_blocks, block_size, config.window_row_width)
        caches += [torch.zeros(window, dtype=dtype, device=device) for _ in caches]
    return caches


@torch.no_grad()
def run_greedy(
    model,
    config: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 4,
    chunk_size: int | None = None,
    start_steps: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> GreedyResult:
    """Greedy-decode every prompt; see the module docstring for `chunk_size` and `start_steps`."""
    start_steps = start_steps or [0] * len(prompts)
    runs = [SequenceRun(list(p), len(p), s) for p, s in zip(prompts, start_steps, strict=True)]
    blocks_per_seq = [math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts]
    offsets = [sum(blocks_per_seq[:i]) for i in range(len(prompts))]
    tables = [list(range(o, o + n)) for o, n in zip(offsets, blocks_per_seq, strict=True)]
    device = next(model.parameters()).device
    caches = allocate_caches(config, sum(blocks_per_seq), block_size, dtype, device)
    step = 0
    while any(len(r.generated) < max_new_tokens for r in runs):
        active = [
            i
            for i, r in enumerate(runs)
            if r.start_step <= step and len(r.generated) < max_new_tokens
        ]
        if active:
            run_step(
                model,
                [runs[i] for i in active],
                [tables[i] for i in active],
                caches,
                block_size,
                chunk_size,
                config.window_span > 0,
            )
        step += 1
    return GreedyResult(
        prompt_logits=[torch.cat(r.prompt_logits) for r in runs],
        token_ids=[r.generated for r in runs],
    )


def run_step(model, runs, tables, caches, block_size, chunk_size, windowed=False) -> None:
    """One forward over the next chunk of every run; appends the greedy token where one is due.
    windowed: the caches end with window caches (allocate_caches), read through `tables`."""
    query_lens = []
    for run in runs:
        remaining = len(run.tokens) - run.num_computed
        query_lens.append(min(remaining, chunk_size) if chunk_size else remaining)
    seq_lens = [r.num_computed + n for r, n in zip(runs, query_lens, strict=True)]
    device = caches[0].device
    positions = torch.tensor(
        [p for r, s in zip(runs, seq_lens, strict=True) for p in range(r.num_computed, s)],
        device=device,
    )
    chunks = [r.tokens[r.num_computed : s] for r, s in zip(runs, seq_lens, strict=True)]
    input_ids = torch.tensor([token for chunk in chunks for token in chunk], device=device)
    attn = build_attention_metadata(
        query_lens, seq_lens, tables, block_size, device, window_tables=tables if windowed else None
    )
    hidden = model(input_ids, positions, ForwardContext(attn, caches))  # [T, H]
    logits = model.compute_logits(hidden)  # [T, V]
    for run, chunk_logits, seq_len in zip(runs, logits.split(query_lens), seq_lens, strict=True):
        prompt_part = max(0, min(seq_len, run.prompt_len) - run.num_computed)
        if prompt_part:
            run.prompt_logits.append(chunk_logits[:prompt_part].cpu())
        run.num_computed = seq_len
        if seq_len == len(run.tokens):
            run.tokens.append(int(chunk_logits[-1].argmax()))


@torch.no_grad()
def run_transformers(path: Path, prompts: list[list[int]], max_new_tokens: int) -> GreedyResult:
    """Each prompt alone (no padding): its prefill logits and `generate(do_sample=False)`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logits, token_ids = [], []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        logits.append(model(input_ids).logits[0].float())
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),  # else token 0 (pad_token_id) is masked
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        token_ids.append(out[0, len(prompt) :].tolist())
    return GreedyResult(logits, token_ids)


def assert_same_greedy(ours: GreedyResult, reference: GreedyResult, atol: float = 1e-4) -> None:
    pairs = zip(ours.prompt_logits, reference.prompt_logits, strict=True)
    for i, (mine, theirs) in enumerate(pairs):
        torch.testing.assert_close(mine, theirs, atol=atol, rtol=0, msg=f"prompt {i} logits")
    pairs = zip(ours.token_ids, reference.token_ids, strict=True)
    for i, (mine, theirs) in enumerate(pairs):
        assert mine == theirs, f"prompt {i}: rayinfer {mine} != transformers {theirs}"


def assert_matches_transformers(
    path: Path,
    prompts: list[list[int]] | None = None,
    max_new_tokens: int = 20,
    device: str = "cpu",
    **run_kwargs,
) -> GreedyResult:
    """rayinfer (on `device`) vs transformers (on the CPU) on `prompts`, 4 of different lengths
    by default; returns ours."""
    model, config = load_rayinfer(path, device=device)
    prompts = prompts or make_prompts(config.vocab_size)
    ours = run_greedy(model, config, prompts, max_new_tokens, **run_kwargs)
    assert_same_greedy(ours, run_transformers(path, prompts, max_new_tokens))
    return ours


# Per DSA family, what its tiny test checkpoints add to TINY_DSA: DeepSeek-V3.2 with
# group-limited routing, GLM-5 with full and shared indexer layers.
DSA_FAMILIES = {
    "deepseek_v32": dict(n_group=4, topk_group=2),
    "glm_moe_dsa": dict(n_group=1, topk_group=1, indexer_types=["full", "shared", "full"]),
}


def make_deepseek_checkpoint(folder: Path, model_type: str, **overrides) -> Path:
    """A transformers DeepSeek (TINY_MLA with `overrides`) made by `save_random_moe`."""
    return save_random_moe(folder, model_type, {**TINY_MLA, **overrides})


def save_random_moe(folder: Path, model_type: str, config_kwargs: dict) -> Path:
    """A transformers MoE of `model_type` with std-0.1 weights, random non-zero correction
    biases and (DeepSeek-V4's hash layers) a random table of distinct experts per token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config_kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_weights(model, seed=0, std=0.1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
            elif name.endswith("tid2eid"):
                experts = config.n_routed_experts
                scores = torch.rand(buffer.shape[0], experts, generator=generator)
                buffer.copy_(scores.topk(buffer.shape[1], dim=-1).indices)
    model.save_pretrained(folder)
    return folder


def make_dsa_checkpoint(folder: Path, model_type: str, **overrides) -> Path:
    """A DeepSeek-V3.2 or GLM-5 (`model_type` deepseek_v32 or glm_moe_dsa) of TINY_DSA's sizes,
    made like make_deepseek_checkpoint's."""
    return make_deepseek_checkpoint(folder, model_type, **{**TINY_DSA, **overrides})


# DeepSeek-V4 small enough for CPU parity tests, with every layer type and a hash layer: a
# window (8) and compression rates (CSA 4, HCA 8) that bite within the prompts, and an indexer
# wide enough (16 heads) that ReLU scores rarely tie, keeping 3 entries of the many a long
# prompt has.
TINY_V4 = dict(
    vocab_size=128,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    hc_mult=2,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    max_position_embeddings=512,
)


def make_v4_checkpoint(folder: Path, **overrides) -> Path:
    """A transformers DeepSeek-V4 (TINY_V4 with `overrides`) made by `save_random_moe`."""
    return save_random_moe(folder, "deepseek_v4", {**TINY_V4, **overrides})


def engine_greedy_tokens(checkpoint, prompts, dtype, max_new_tokens: int, device="cuda"):
    """The offline engine's greedy tokens in chunks of 64 (the GPU parity tests' run)."""
    import rayinfer

    llm = rayinfer.LLM(
        str(checkpoint), device=device, dtype=dtype, max_num_batched_tokens=64, max_model_len=512
    )
    params = rayinfer.SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    try:
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def relative_errors(logits, reference):
    """Per position ||logits - reference|| / ||reference|| over the vocabulary: [n]."""
    return (logits.float() - reference).norm(dim=-1) / reference.norm(dim=-1)
