"""Internal configuration: frozen dataclasses validated at construction.

`ModelConfig` is read from a Hugging Face `config.json`; `ParallelPlan` (parallel_plan.py) says
how one phase spreads it over workers. The engine's sizes are in engine_config.py, the token
exchange's options in exchange_config.py, the overlap's in overlap_config.py; `EngineArgs`
(engine_args.py) gathers them. Pydantic lives only at the Serve boundary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rayinfer.config_error import ConfigError
from rayinfer.config_v4 import V4Config
from rayinfer.parallel_plan import ParallelPlan as ParallelPlan  # where its users import it

SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "DeepseekV4ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# DeepSeek Sparse Attention (MLA plus a lightning indexer that picks index_topk tokens per query)
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", *DSA_ARCHITECTURES)
# DeepSeek-V4: one shared key/value head over a sliding window plus compressed entries
# (config_v4.py has its values and cache rows)
V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
INDEXER_TYPES = ("full", "shared")
# How DSA layers cache indexer keys: "auto" in the cache's dtype (the model's; what transformers
# parity needs), "fp8_e4m3" as D FP8 e4m3 bytes plus one float32 scale per token (DeepSeek's
# production format), inside the cache row's own dtype (kernels/dsa/dsa_index_fp8.py).
INDEX_CACHE_DTYPES = ("auto", "fp8_e4m3")
INDEX_SCALE_BYTES = 4  # the float32 scale after a token's FP8 key
# FP8-key rows are padded to a multiple of 16 bytes: Triton takes a row stride of 16-byte
# multiples as such and otherwise assumes alignments the rows lack (the FP8 score kernel hit a
# misaligned address on an H200 with 1,284-byte rows; tests/gpu/test_dsa_fp8_kernels.py)
ROW_ALIGN_BYTES = 16


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a checkpoint, with the values every family needs named explicitly.

    Family-specific values that only one model file reads stay in `hf` (the raw config.json).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # MoE (num_experts == 0 for dense models)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    # MLA (DeepSeek V2/V3); zero elsewhere
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DSA (DeepSeek-V3.2, GLM-5); zero elsewhere. indexer_types[i]: "full" layers run the
    # indexer, "shared" ones reuse the previous full layer's selection
    index_head_dim: int = 0
    index_n_heads: int = 0
    index_topk: int = 0
    indexer_types: tuple[str, ...] = ()
    index_cache_dtype: str = "auto"  # one of INDEX_CACHE_DTYPES; set by with_index_cache_dtype
    path: str | None = None
    hf: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model={str(path)!r}: no config.json in that folder")
        hf = json.loads(config_file.read_text())
        return cls.from_hf_dict(hf, path=str(path))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], path: str | None = None) -> ModelConfig:
        architectures = hf.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"architectures={architectures!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_mla = arch in MLA_ARCHITECTURES
        common = dict(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf.get("intermediate_size", 0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            path=path,
            hf=hf,
        )
        moe = _moe_fields(arch, hf)
        mla = _mla_fields(hf) if is_mla else {}
        dsa = _dsa_fields(hf) if arch in DSA_ARCHITECTURES else {}
        if arch == V4_ARCHITECTURE:
            V4Config.from_hf(hf)  # checked here, so a bad key fails before any weight loads
            mla = dict(q_lora_rank=hf.get("q_lora_rank"))
        return cls(**common, **moe, **mla, **dsa)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.architecture in MLA_ARCHITECTURES

    @property
    def is_dsa(self) -> bool:
        return self.architecture in DSA_ARCHITECTURES

    @property
    def is_v4(self) -> bool:
        return self.architecture == V4_ARCHITECTURE

    @property
    def kv_is_replicated(self) -> bool:
        """Whether every tensor-parallel rank caches the same row per token (MLA's latent, V4's
        one key/value head) rather than its share of the K/V heads."""
        return self.is_mla or self.is_v4

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek-style layer pattern: `mlp_layer_types` when the config has it, else MoE
        from `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
        mlp_layer_types = self.hf.get("mlp_layer_types")
        if mlp_layer_types:
            return self.is_moe and mlp_layer_types[layer_idx] == "sparse"
        first_moe = self.hf.get("first_k_dense_replace") or 0
        frequency = self.hf.get("moe_layer_freq") or 1
        return self.is_moe and layer_idx >= first_moe and layer_idx % frequency == 0

    def with_index_cache_dtype(self, index_cache_dtype: str, key: str = "index_cache_dtype"):
        """This config with its indexer keys cached as `index_cache_dtype` (checked: a value of
        INDEX_CACHE_DTYPES, and FP8 only for DSA models; a ConfigError names `key`)."""
        if index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ConfigError(
                f"{key}={index_cache_dtype!r}; use one of {', '.join(INDEX_CACHE_DTYPES)}"
            )
        if index_cache_dtype != "auto" and not self.is_dsa:
            raise ConfigError(
                f"{key}={index_cache_dtype!r} is for DeepSeek Sparse Attention models "
                f"({', '.join(DSA_ARCHITECTURES)}); {self.architecture} caches no indexer keys, "
                "use 'auto'"
            )
        return replace(self, index_cache_dtype=index_cache_dtype)

    @property
    def index_keys_fp8(self) -> bool:
        return self.index_cache_dtype == "fp8_e4m3"

    def index_key_columns(self, dtype_bytes: int) -> int:
        """Columns of a cache row (elements of `dtype_bytes`) that hold a token's indexer key:
        D in the cache's dtype, or with FP8 keys D bytes + a 4-byte scale, padded so that the
        row's bytes are a multiple of ROW_ALIGN_BYTES (GLM-5 in bf16: 72, a 648-column row)."""
        if not self.index_keys_fp8:
            return self.index_head_dim
        key_bytes = self.index_head_dim + INDEX_SCALE_BYTES
        latent_bytes = (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        if (latent_bytes + self.index_head_dim) % INDEX_SCALE_BYTES:
            raise ConfigError(
                f"index_cache_dtype='fp8_e4m3' needs the float32 scale after index_head_dim="
                f"{self.index_head_dim} key bytes at a 4-byte offset; use 'auto'"
            )
        row_bytes = -(-(latent_bytes + key_bytes) // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
        return (row_bytes - latent_bytes) // dtype_bytes

    def kv_shape_per_token(self, dtype_bytes: int) -> tuple[int, ...]:
        """Shape of one token's cache entry in the widest layer, in a cache of `dtype_bytes`
        elements: the row a hand-off carries for every layer (`kv_shapes_per_layer`).

        MLA caches the compressed latent and the shared rope key, DSA its indexer key after them
        (`index_key_columns`); DeepSeek-V4 its pooled entries' shares; other families K and V.
        """
        if self.is_mla:
            latent = self.kv_lora_rank + self.qk_rope_head_dim
            return (latent + self.index_key_columns(dtype_bytes),)
        if self.is_v4:  # the pooled entries' shares (config_v4.V4EntryRow)
            return (V4Config.from_hf(self.hf).entry_row.width,)
        return (2, self.num_kv_heads, self.head_dim)

    @property
    def window_span(self) -> int:
        """Tokens of window state a step reads before its first one (DeepSeek-V4's window
        pool, config_v4.py); 0: the model keeps no window pool."""
        return V4Config.from_hf(self.hf).window_span if self.is_v4 else 0

    @property
    def window_row_width(self) -> int:
        """Columns of one token's row per layer in the window pool (0: none)."""
        return V4Config.from_hf(self.hf).window_row.width if self.is_v4 else 0

    def kv_shapes_per_layer(self, dtype_bytes: int) -> tuple[tuple[int, ...], ...]:
        """Per layer the shape of one token's cache entry: `kv_shape_per_token`'s, cut where a
        layer keeps less. DSA's "shared" indexer layers keep no indexer key (the latent and rope
        key only); DeepSeek-V4's layers keep their own type's entries (`V4Config.entry_width`:
        160 columns for CSA, 4 for HCA and 1 for a sliding layer in V4-Flash)."""
        if self.is_v4:
            v4 = V4Config.from_hf(self.hf)
            return tuple((v4.entry_width(i),) for i in range(self.num_layers))
        widest = self.kv_shape_per_token(dtype_bytes)
        if self.is_dsa and self.indexer_types:
            latent = (self.kv_lora_rank + self.qk_rope_head_dim,)
            return tuple(widest if kind == "full" else latent for kind in self.indexer_types)
        return (widest,) * self.num_layers

    def kv_shape_per_token_on_rank(self, tp_size: int, dtype_bytes: int) -> tuple[int, ...]:
        """One tensor-parallel rank's share: K/V heads split; MLA's latent and V4's one
        key/value head are replicated."""
        if self.kv_is_replicated or tp_size == 1:
            return self.kv_shape_per_token(dtype_bytes)
        return (2, self.num_kv_heads // tp_size, self.head_dim)

    def kv_shapes_on_rank(self, tp_size: int, dtype_bytes: int) -> tuple[tuple[int, ...], ...]:
        """`kv_shapes_per_layer` on one tensor-parallel rank (K/V heads split)."""
        if self.kv_is_replicated or tp_size == 1:
            return self.kv_shapes_per_layer(dtype_bytes)
        return (self.kv_shape_per_token_on_rank(tp_size, dtype_bytes),) * self.num_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        shapes = self.kv_shapes_per_layer(dtype_bytes)
        return sum(math.prod(shape) for shape in shapes) * dtype_bytes


def _rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(hf: dict) -> dict | None:
    """The rope scaling dict, None for plain RoPE (transformers 5 names it `rope_parameters`)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


def _moe_fields(arch: str, hf: dict) -> dict:
    if arch in MLA_ARCHITECTURES or arch == V4_ARCHITECTURE:
        num_experts = hf.get("n_routed_experts") or 0
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            num_shared_experts=hf.get("n_shared_experts") or 0,
        )
    if arch == "Qwen3MoeForCausalLM":
        return dict(
            # transformers >= 5 saves `num_local_experts`; hub checkpoints say `num_experts`
            num_experts=hf.get("num_experts") or hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
        )
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["intermediate_size"],
        )
    return {}


def _mla_fields(hf: dict) -> dict:
    return dict(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
    )


def _dsa_fields(hf: dict) -> dict:
    """The indexer's sizes; `indexer_types` checked for its length and values (GLM-5 names
    it; DeepSeek-V3.2 runs the indexer in every layer)."""
    num_layers = hf["num_hidden_layers"]
    indexer_types = hf.get("indexer_types") or ["full"] * num_layers
    if len(indexer_types) != num_layers:
        raise ConfigError(
            f"indexer_types has {len(indexer_types)} entries; it needs one per layer "
            f"(num_hidden_layers={num_layers})"
        )
    for i, kind in enumerate(indexer_types):
        if kind not in INDEXER_TYPES:
            raise ConfigError(
                f"indexer_types[{i}]={kind!r} is unknown; use one of {', '.join(INDEXER_TYPES)}"
            )
    if indexer_types[0] != "full":
        raise ConfigError(
            "indexer_types[0] must be 'full': a 'shared' layer reuses the selection of the "
            "previous full layer, and layer 0 has none"
        )
    if not hf.get("q_lora_rank"):
        raise ConfigError("q_lora_rank must be set: the DSA indexer's queries read the query LoRA")
    for key in ("index_head_dim", "index_n_heads", "index_topk"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise ConfigError(f"{key}={hf.get(key)!r} must be a positive integer")
    if hf["index_head_dim"] < hf["qk_rope_head_dim"]:
        raise ConfigError(
            f"index_head_dim={hf['index_head_dim']} must be >= qk_rope_head_dim="
            f"{hf['qk_rope_head_dim']} (the indexer ropes its first qk_rope_head_dim columns)"
        )
    return dict(
        index_head_dim=hf["index_head_dim"],
        index_n_heads=hf["index_n_heads"],
        index_topk=hf["index_topk"],
        indexer_types=tuple(indexer_types),
    )
